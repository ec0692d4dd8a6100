"""A fresh process that resumes a ``save_state`` checkpoint and takes its first training step.

    python -m benchmarks.first_step --url URL --options JSON --staging DIR --out FILE \\
        --spawned-at EPOCH_SECONDS

Used by the ``torch-resume`` group (``benchmarks/resume.py``): the time from the moment the
parent spawned this process to the end of its first training step, split into process start
and imports, the claim of the run, listing, transfer, verification and load (from
``LoadReport``), ``load_state_dict`` into a model, and the step itself (one in-place update
of every weight, standing in for the optimizer step). Written as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time

STARTED = time.time()  # before the heavy imports


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--options", default="{}")
    p.add_argument("--staging", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--spawned-at", type=float, required=True)
    p.add_argument("--device", default=None)
    args = p.parse_args()

    import torch

    from cloudckpt import CheckpointManager
    from cloudckpt.integrations.torch import LoadReport, resume_state

    imported = time.time()
    mgr = CheckpointManager(
        args.url, storage_options=json.loads(args.options), staging_dir=args.staging
    )
    report = LoadReport()
    t0 = time.time()
    state = resume_state(mgr, device=args.device, report=report)
    resumed = time.time()
    if state is None:
        raise SystemExit("nothing to resume")
    # The model the state belongs to: one parameter per tensor.
    model = torch.nn.ParameterDict(
        {k.replace(".", "_"): torch.nn.Parameter(torch.empty_like(v)) for k, v in state.items()}
    )
    model.load_state_dict({k.replace(".", "_"): v for k, v in state.items()})
    loaded = time.time()
    with torch.no_grad():
        for param in model.values():
            param.mul_(0.999)  # the first step touches every weight
    if torch.cuda.is_available() and args.device:
        torch.cuda.synchronize()
    stepped = time.time()
    result = {
        "startup_s": imported - args.spawned_at,
        "interpreter_s": STARTED - args.spawned_at,
        "claim_s": (resumed - t0) - report.total_s,
        "listing_s": report.listing_s,
        "transfer_s": report.transfer_s,
        "verify_s": report.verify_s,
        "load_s": report.load_s,
        "load_state_dict_s": loaded - resumed,
        "step_s": stepped - loaded,
        "to_first_step_s": stepped - args.spawned_at,
        "bytes_downloaded": float(report.bytes_downloaded),
        "bytes_local": float(report.bytes_local),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    mgr.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
