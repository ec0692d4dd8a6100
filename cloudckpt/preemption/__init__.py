"""Preemption notices: signals and the spot/preemptible notices of AWS, GCE and Azure.

A ``PreemptionWatcher`` turns every way a cloud says "this machine is going away" into one
flag that a training loop can check at each step boundary::

    from cloudckpt.preemption import PreemptionWatcher

    with PreemptionWatcher() as watcher:          # SIGTERM + the cloud this host runs on
        for step in range(start, total):
            train_step()
            if watcher.preempted:
                save_checkpoint(step).result(timeout=watcher.seconds_left())
                break

Sources (``sources=`` names them; ``"auto"`` picks ``signal`` plus the cloud this host runs
on, detected from DMI data in ``/sys/class/dmi/id`` without any network request):

=========  ==========================================================================
``signal``  SIGTERM by default (``signals=``). Kubernetes, Slurm, systemd, GCE/Azure
            shutdown and ``docker stop`` all send it before killing the process.
``aws``     EC2 spot ``instance-action`` (IMDSv2: PUT ``/latest/api/token``, then GET
            ``/latest/meta-data/spot/instance-action``; 404 means no notice). The
            notice's ``time`` (about two minutes ahead) becomes the deadline.
``gce``     ``/computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``;
            ``TRUE`` means preempted. GCE gives 30 s, so the deadline is notice + 30 s.
``azure``   Scheduled Events (``/metadata/scheduledevents``, ``Metadata: true``): an
            event of type ``Preempt`` (``event_types=``) naming this VM. ``NotBefore`` is
            the deadline.
=========  ==========================================================================

Endpoints default to the real metadata services and can be changed with arguments
(``aws_url=``, ``gce_url=``, ``azure_url=``) or environment variables
(``CLOUDCKPT_AWS_METADATA_URL``, ``CLOUDCKPT_GCE_METADATA_URL``,
``CLOUDCKPT_AZURE_METADATA_URL``; also the standard ``AWS_EC2_METADATA_SERVICE_ENDPOINT``
and ``GCE_METADATA_HOST``). ``CLOUDCKPT_PREEMPTION_SOURCES=signal,aws`` overrides
``"auto"``. Setting an endpoint variable adds that source to ``"auto"``.

Polling runs in one daemon thread every ``interval`` seconds (5 by default) with short
request timeouts. A metadata request that fails, times out or answers nonsense is logged at
DEBUG and retried at the next poll: a watcher never raises into training.

Signals: handlers are installed only from the main thread (Python's rule); started
elsewhere, the watcher logs a warning and watches the cloud sources only. The first signal
sets the flag and calls a previously installed Python handler (so frameworks that also
listen, such as Lightning, still hear it), but not the default action (which would end the
process before the emergency save). A second identical signal (``escalate_on_repeat``)
restores the previous disposition and re-delivers the signal, so an impatient operator can
still stop the process the usual way. ``stop()`` restores the previous handlers. The
handler itself only records the signal and writes one byte to a pipe; the flag's event and
the callbacks are set and run on the watcher thread, never inside the signal handler.

Where things live: ``notice`` (``PreemptionNotice``, the ``PreemptionSource`` interface),
``signals`` (the ``signal`` source: the handlers), ``sources`` (the cloud sources, their
endpoints, detection), ``watcher`` (``PreemptionWatcher``: the thread, the flag, the
callbacks). Import everything from ``cloudckpt.preemption``.
"""

from cloudckpt.preemption.notice import PreemptionNotice, PreemptionSource
from cloudckpt.preemption.sources import AWS_DEFAULT_URL as AWS_DEFAULT_URL
from cloudckpt.preemption.sources import AZURE_API_VERSION as AZURE_API_VERSION
from cloudckpt.preemption.sources import AZURE_COMPUTE_API_VERSION as AZURE_COMPUTE_API_VERSION
from cloudckpt.preemption.sources import AZURE_DEFAULT_URL as AZURE_DEFAULT_URL
from cloudckpt.preemption.sources import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from cloudckpt.preemption.sources import GCE_DEFAULT_URL as GCE_DEFAULT_URL
from cloudckpt.preemption.sources import GCE_NOTICE_SECONDS as GCE_NOTICE_SECONDS
from cloudckpt.preemption.sources import (
    AWSSpotSource,
    AzureScheduledEventsSource,
    GCEPreemptedSource,
    detect_clouds,
)
from cloudckpt.preemption.watcher import DEFAULT_INTERVAL as DEFAULT_INTERVAL
from cloudckpt.preemption.watcher import NoticeCallback as NoticeCallback
from cloudckpt.preemption.watcher import PreemptionWatcher

__all__ = [
    "AWSSpotSource",
    "AzureScheduledEventsSource",
    "GCEPreemptedSource",
    "PreemptionNotice",
    "PreemptionSource",
    "PreemptionWatcher",
    "detect_clouds",
]
