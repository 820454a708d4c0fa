"""kvxfer: the engine side of kvxferd.

- :mod:`kvxfer.client`: a plain client for the kvxfer.v1 services (worker
  stream per rank, scheduler, peer), with typed errors (:mod:`kvxfer.errors`).
- :mod:`kvxfer.shm`: shared-memory files the daemon accepts as host KV memory.
- :mod:`kvxfer.vllm`: ``KvxferConnector``, vLLM's KV connector over kvxferd
  (imports vLLM; load it with ``kv_connector_module_path: "kvxfer.vllm"``).
"""

from kvxfer.client import Client, Finished, Scheduler, StepResult, WorkerStream
from kvxfer.errors import (DaemonError, FailedPrecondition, InvalidArgument, KvxferError, NotFound,
                           StreamClosed, Unavailable)
from kvxfer.v1 import kvxfer_pb2 as pb

__all__ = ["Client", "Scheduler", "WorkerStream", "StepResult", "Finished", "DaemonError", "InvalidArgument",
           "NotFound", "FailedPrecondition", "Unavailable", "KvxferError", "StreamClosed", "pb"]
