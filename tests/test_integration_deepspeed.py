"""DeepSpeed through cloudckpt (cloudckpt.integrations.deepspeed): a real DeepSpeed job on
CPU (gloo) under torchrun saves to the moto S3 server and resumes on a fresh staging
directory, and the resumed job ends bit for bit where the uninterrupted one ended."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cloudckpt.reader import load_latest_for_reading
from cloudckpt.stores import open_store

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_train.py"


def _torchrun(ranks: int, phase: str, url: str, options: dict, tmp: Path) -> None:
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "CLOUDCKPT_TEST_STORAGE_OPTIONS": json.dumps(options),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
         f"--master_port={port}", str(SCRIPT), "--phase", phase, "--url", url,
         "--out", str(tmp), "--staging", str(tmp / f"staging-{phase}")],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_save_and_resume_on_a_fresh_directory_is_exact(moto_server, tmp_path, ranks):
    bucket = f"deepspeed-{ranks}"
    moto_server.create_bucket(bucket)
    url, options = f"s3://{bucket}/run", moto_server.storage_options()
    _torchrun(ranks, "save", url, options, tmp_path)
    _torchrun(ranks, "resume", url, options, tmp_path)

    store = open_store(url, options)
    try:
        latest, _ = load_latest_for_reading(store)
    finally:
        store.close()
    current = latest.current
    assert current.step == 3 and current.metadata["deepspeed"]["tag"] == "global_step3"
    shards = [f"global_step3/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ranks)]
    for r in range(ranks):
        saved = torch.load(tmp_path / f"save-rank{r}.pt", weights_only=False)
        resumed = torch.load(tmp_path / f"resume-rank{r}.pt", weights_only=False)
        assert saved["step"] == resumed["step"] == 3
        assert resumed["client_state"] == {"epoch": 7}
        # DeepSpeed's own layout, every rank's ZeRO shard in it
        assert {"latest", "global_step3/mp_rank_00_model_states.pt", *shards} <= set(
            resumed["files"]
        )
        for when in ("at_save", "at_end"):  # model at the save, then after 2 more steps
            assert saved[when].keys() == resumed[when].keys()
            for name, tensor in saved[when].items():
                assert torch.equal(tensor, resumed[when][name]), (r, when, name)
