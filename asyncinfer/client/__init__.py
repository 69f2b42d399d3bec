"""The Python SDK for asyncinfer's JobService.

    from asyncinfer.client import AsyncClient, Client

    async with AsyncClient("127.0.0.1:50051", api_key=KEY) as client:
        job = await client.submit("demo", {"x": np.ones((2, 4), np.float32)})
        done = await client.wait(job, timeout_s=60)
        print(done.state, done.outputs["y"])

`AsyncClient` is the asyncio client; `Client` is the same API, blocking. Results are frozen
dataclasses (`Job`, `BulkResult`, `BlobRef`) with numpy outputs; errors derive from
`AsyncInferClientError`. Protobuf stays inside the SDK. `verify_webhook` checks a webhook delivery's
signature and age on the receiving side (standard library only). An enum value newer than the SDK
(a state a newer gateway added) reads as `UNKNOWN_<number>` of its enum, never an error
(`unknown_number`).
"""

from asyncinfer.batches import BatchState
from asyncinfer.client._async import AsyncClient, tls_credentials
from asyncinfer.client._enums import unknown_number
from asyncinfer.client._retry import NO_RETRY, RetryPolicy
from asyncinfer.client._sync import Client, JobListingIterator, StreamIterator
from asyncinfer.client.batches import Batch, BatchError, BatchPage, BatchReadProgress
from asyncinfer.client.errors import (
    AlreadyExistsError,
    AsyncInferClientError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    JobFailedError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from asyncinfer.client.job_listing import JobListing
from asyncinfer.client.jobs_watch import JobsWatch
from asyncinfer.client.types import (
    BatchInfo,
    BlobRef,
    BulkResult,
    Callback,
    CallbackDelivery,
    CallbackDeliveryState,
    CallbackEvent,
    FieldViolation,
    Job,
    JobError,
    JobProgress,
    JobRequest,
    JobState,
    ModelInfo,
    ModelVersion,
    Priority,
    QueuePosition,
    TensorSpec,
    WaitingReason,
    why_not_served,
)
from asyncinfer.client.webhooks import WebhookVerificationError, verify_webhook

__all__ = [
    "NO_RETRY",
    "AlreadyExistsError",
    "AsyncClient",
    "AsyncInferClientError",
    "Batch",
    "BatchError",
    "BatchInfo",
    "BatchPage",
    "BatchReadProgress",
    "BatchState",
    "BlobRef",
    "BulkResult",
    "Callback",
    "CallbackDelivery",
    "CallbackDeliveryState",
    "CallbackEvent",
    "CancelledError",
    "Client",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FieldViolation",
    "InternalError",
    "InvalidArgumentError",
    "Job",
    "JobError",
    "JobFailedError",
    "JobListing",
    "JobListingIterator",
    "JobProgress",
    "JobRequest",
    "JobState",
    "JobsWatch",
    "ModelInfo",
    "ModelVersion",
    "NotFoundError",
    "PermissionDeniedError",
    "Priority",
    "QueuePosition",
    "ResourceExhaustedError",
    "RetryPolicy",
    "StreamIterator",
    "TensorSpec",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "WaitingReason",
    "WebhookVerificationError",
    "tls_credentials",
    "unknown_number",
    "verify_webhook",
    "why_not_served",
]
