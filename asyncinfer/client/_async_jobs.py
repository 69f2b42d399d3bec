"""AsyncClient's calls on single jobs and job listings (asyncinfer.client._async): submit (its inputs typed
by the model's signature from ListModels), get, get_jobs, models, cancel and list."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

import grpc

from asyncinfer.client._async_channel import ClientChannel, JobLike, _enum, _job_id, _job_ids, _unary_budget
from asyncinfer.client._convert import (
    Declined,
    check_options,
    check_seconds,
    declined_input,
    error_from_proto,
    explained,
    input_array,
    inputs_example,
    inputs_form_problem,
    job_from_proto,
    model_name_problem,
    models_from_proto,
    signature_refused,
    state_to_proto,
    submit_request_to_proto,
    with_idempotency_key,
)
from asyncinfer.client._retry import Deadline
from asyncinfer.client.errors import (
    AsyncInferClientError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    UnimplementedError,
    make_error,
)
from asyncinfer.client.job_listing import JobListing
from asyncinfer.client.types import BlobRef, Callback, Inputs, Job, JobRequest, JobState, ModelInfo, Priority
from asyncinfer.tensors import Tensor, TensorSpec, as_one_row, typed_as
from asyncinfer.v1 import job_service_pb2


def _wait_within(call_timeout_s: float) -> float:
    """How long a SubmitJob whose call has `call_timeout_s` asks the gateway to wait: its answer
    then leaves a quarter of the call's time (at most a second) before the deadline, so that on a
    busy machine it still arrives in time (the gateway's own margin, 0.25 s, is the last resort)."""
    return max(call_timeout_s - min(call_timeout_s / 4, 1.0), 0.0)


# The most IDs one GetJobs call and one WatchJobs stream may carry (the gateway's limits).
GET_JOBS_MAX_IDS = 1000
SUBMIT_JOBS_MAX_ITEMS = 1000
WATCH_JOBS_MAX_IDS = 10_000


class JobCalls(ClientChannel):
    """AsyncClient's unary job calls: submit, get, get_jobs, models, cancel, and list's pages."""

    async def submit(
        self,
        model: str,
        inputs: Inputs | None = None,
        *,
        input_ref: str | BlobRef = "",
        model_version: str = "",
        priority: Priority | str | None = None,
        idempotency_key: str = "",
        labels: Mapping[str, str] | None = None,
        deadline: datetime | None = None,
        queue_ttl_s: float | None = None,
        execution_timeout_s: float | None = None,
        retention_s: float | None = None,
        callback: Callback | str | None = None,
        max_attempts: int = 0,
        timeout_s: float | None = None,
        traceparent: str = "",
        wait_s: float | None = None,
    ) -> Job:
        """Queues a job on `model` and returns it (QUEUED) as soon as it is durably queued.

        `inputs` maps input names to arrays (numpy arrays or anything `numpy.asarray` takes,
        such as nested lists), or is a list of `Tensor`s; or give `input_ref` from `upload`.
        Arrays and lists are typed by the model's signature where nothing is lost (ints and floats
        to FP16/FP32/FP64, ints to an integer type they fit, bools to BOOL, strings to BYTES), as
        the gateway's ListModels says (asked once per client, and again after the gateway refused
        a submit of the model for an input's datatype or shape: a hot update may have changed
        or loaded it; within half of `timeout_s`: the submit's one deadline covers
        both calls; with `model_version`, that version's signature); a `Tensor` is sent as it is.
        `deadline` / `queue_ttl_s`: it expires unless started by then.

        Idempotency: without an `idempotency_key` the SDK generates one (a UUID) for this call, so
        that retrying after UNAVAILABLE or a lost answer cannot queue the job twice. Pass your own
        key to make resubmitting from another process (or after a crash) safe as well; a second
        submit with a used key and the same request returns the first job (its ID, its state now), one with
        another request under it raises AlreadyExistsError (IDEMPOTENCY_KEY_REUSED).

        `traceparent`: a W3C trace context (`00-<trace id>-<span id>-<flags>`) for the job's trace to
        continue, when the gateway traces jobs (`Job.trace_id` is then that trace's).

        `wait_s`: the gateway holds its answer until the job ends or this long passes (at most
        its gateway.max_submit_wait_s, 60 s by default, and leaving the answer a quarter of
        `timeout_s`, at most a second, before the call's deadline), in one call; the
        job returned is then finished (`job.done`) or as it stood, to `wait` for as usual.
        """
        request = JobRequest(
            model=model,
            inputs=inputs,
            input_ref=input_ref.ref if isinstance(input_ref, BlobRef) else input_ref,
            model_version=model_version,
            priority=_enum(Priority, priority, "priority") if priority is not None else None,
            idempotency_key=idempotency_key,
            labels=dict(labels or {}),
            deadline=deadline,
            queue_ttl_s=queue_ttl_s,
            execution_timeout_s=execution_timeout_s,
            retention_s=retention_s,
            callback=Callback(callback) if isinstance(callback, str) else callback,
            max_attempts=max_attempts,
        )
        return await self.submit_request(request, timeout_s=timeout_s, traceparent=traceparent, wait_s=wait_s)

    async def submit_request(
        self, request: JobRequest, *, timeout_s: float | None = None, traceparent: str = "", wait_s: float | None = None
    ) -> Job:
        """`submit` with the job given as a `JobRequest` (an idempotency key is generated the same way)."""
        deadline = self._deadline(timeout_s)
        check_options(request)
        if wait_s is not None:
            check_seconds(wait_s, "wait_s", infinite=True)
        # One deadline for the typing and the submit: typing's ListModels had a whole timeout_s of
        # its own, and a gateway that did not answer it made a submit take twice its timeout_s.
        # Typing gets at most half, so that the submit itself keeps time to be sent.
        remaining = deadline.remaining()
        request, declined = await self._typed(request, Deadline(None if remaining is None else remaining / 2))
        message = submit_request_to_proto(with_idempotency_key(request))
        if wait_s:
            call_timeout_s = deadline.remaining()
            call_timeout_s = self.timeout_s if call_timeout_s is None else call_timeout_s
            message.wait.FromNanoseconds(int(min(wait_s, _wait_within(call_timeout_s)) * 1e9))
        metadata = (*self._metadata, ("traceparent", traceparent)) if traceparent else self._metadata

        async def invoke(remaining: float | None) -> job_service_pb2.SubmitJobResponse:
            return await self._stub.SubmitJob(message, timeout=remaining, metadata=metadata)

        try:
            response = await self._call(invoke, deadline)
        except InvalidArgumentError as error:
            if signature_refused(error.violations):
                self.forget_signature(request.model)
            error.violations = explained(error.violations, [t.name for t in message.inputs], declined)
            raise
        return job_from_proto(response.job)

    async def _typed(self, request: JobRequest, typing: Deadline) -> tuple[JobRequest, Declined]:
        """The request with each input given as an array or plain values (not a `Tensor`) typed
        by the model's signature where that loses nothing (a list of ints or a float64 array for
        an FP32 input: float32); anything else is left as it is, for the gateway to judge. A
        torch tensor is sent as its values (`input_array`), and values numpy makes no tensor of
        (ragged rows, complex numbers) are a ValueError naming the input.
        TypeError, before anything is sent, for a model that is no name (the arguments swapped)
        or inputs that are no mapping of names (an array alone), naming the model's inputs.
        With it, the inputs left as they were for the signature (`Declined`: a refusal of them
        says why, `explained`).
        `typing`: when asking ListModels for the signature stops being worth it."""
        if problem := model_name_problem(
            request.model, "the name comes first, as in submit(model, inputs) and JobRequest(model, inputs)"
        ):
            raise TypeError(problem)
        inputs = request.inputs
        version = request.model_version
        if problem := inputs_form_problem(inputs):
            specs = await self._specs(request.model, typing, version)
            raise TypeError(f"{problem}: {inputs_example(request.model, specs)}")
        if not isinstance(inputs, Mapping) or not inputs:
            return request, {}
        specs = await self._specs(request.model, typing, version)
        typed: dict[str, Any] = {}
        declined: Declined = {}
        for name, value in inputs.items():
            if isinstance(value, Tensor):
                typed[name] = value
                continue
            spec = specs.get(name)
            array = input_array(name, value, request.model, spec)
            as_signature = None if spec is None else typed_as(array, spec.datatype)
            array = array if as_signature is None else as_signature
            # One row without its batch dimension ([1, 2, 3, 4] for [-1, 4], one text for [-1]) is
            # that row, as the CLI's -i and a JSONL batch line take it: it was refused "must have
            # shape [-1, 4] (-1: any), got [4]" here while the CLI sent [[1, 2, 3, 4]].
            typed[name] = array if spec is None else as_one_row(array, spec)
            if (
                as_signature is None
                and spec is not None
                and (why := declined_input(name, array, request.model, spec, value))
            ):
                declined[name] = why
        return replace(request, inputs=typed), declined

    async def _specs(self, model: str, typing: Deadline, version: str = "") -> dict[str, TensorSpec]:
        """The input specs by name of the model's `version` where ListModels gives them, else of
        the model (the version a job that pins none runs on now): those a pinned submit was typed by
        were the default's, and `[[1, 2, 3, 4]]` for a version taking INT64 went as FP32, refused."""
        specs = await self._model_specs(model, typing)
        return self._version_specs.get((model, version), specs) if version else specs

    async def _model_specs(self, model: str, typing: Deadline) -> dict[str, TensorSpec]:
        """The model's input specs by name (cached; {} for a model the gateway does not list, or
        when `typing` passes before they are known)."""
        async with self._specs_lock:
            if typing.expired():  # spent waiting for another submit's ListModels
                return (self._input_specs or {}).get(model, {})
            known = self._input_specs
            if not self._list_models_unimplemented and (
                known is None or (model not in known and model not in self._unlisted)
            ):
                try:
                    # One attempt: when the gateway is unavailable the submit's own retries wait.
                    models = await self._models(typing.remaining(), retry=False)
                except UnimplementedError:
                    self._list_models_unimplemented = True
                except AsyncInferClientError as error:
                    # Typing is a convenience: the submit goes on with the inputs as given (and a
                    # gateway that was unavailable, its name unknown to DNS included, is asked
                    # again on the next submit).
                    if self.retry.retriable(error) or isinstance(error, DeadlineExceededError | UnavailableError):
                        return {}
                else:
                    self._remember_models(models)
                if self._input_specs is None:
                    self._input_specs = {}
                if model not in self._input_specs:
                    self._unlisted.add(model)
            return (self._input_specs or {}).get(model, {})

    async def _require_served(self, model: str) -> None:
        """NotFoundError, as the gateway answers a create for it (MODEL_NOT_FOUND), for a model
        ListModels does not list: create_batch asks before its upload, which was refused only once
        the whole file had gone up. A model in the cache (any submit's or create's ListModels) costs
        nothing; another asks ListModels once more (one loaded since is then found), and any failure
        to answer (a gateway without ListModels, unavailable, a key not allowed it) leaves the check
        to the create."""
        if self._input_specs is not None and model in self._input_specs:
            return
        if self._list_models_unimplemented:
            return
        async with self._specs_lock:
            try:
                models = await self._models(self._deadline(None).remaining(), retry=False)
            except UnimplementedError:
                self._list_models_unimplemented = True
                return
            except AsyncInferClientError:
                return
            self._remember_models(models)
        if model not in {info.name for info in models}:
            known = ", ".join(sorted({info.name for info in models})) or "none"
            raise NotFoundError(
                f"unknown model {model[:64]!r}; the models served are: {known}",
                code=grpc.StatusCode.NOT_FOUND,
                reason="MODEL_NOT_FOUND",
                metadata={"model": model[:64], "known_models": known},
            )

    def _remember_models(self, models: list[ModelInfo]) -> None:
        """ListModels' answer as the cache of input specs (by model, and by model and version)."""
        specs: dict[str, dict[str, TensorSpec]] = {}
        versions: dict[tuple[str, str], dict[str, TensorSpec]] = {}
        for info in models:
            specs.setdefault(info.name, {spec.name: spec for spec in info.inputs})
            for listed in info.versions:
                if listed.inputs:  # an older gateway lists none: the model's then
                    versions.setdefault((info.name, listed.version), {spec.name: spec for spec in listed.inputs})
        self._input_specs = specs
        self._version_specs = versions
        self._unlisted -= specs.keys()

    async def _next_typed(self, source: AsyncGenerator[JobRequest, None]) -> tuple[JobRequest, Declined]:
        return await self._typed(await anext(source), self._deadline(None))

    async def get(self, job: JobLike, *, timeout_s: float | None = None) -> Job:
        """The job as it stands now. NotFoundError for an unknown job (reason JOB_NOT_FOUND) or one
        whose retention passed (JOB_RETENTION_PASSED)."""
        message = job_service_pb2.GetJobRequest(job_id=_job_id(job))

        async def invoke(remaining: float | None) -> job_service_pb2.GetJobResponse:
            return await self._stub.GetJob(message, timeout=remaining, metadata=self._metadata)

        response = await self._call(invoke, self._deadline(timeout_s))
        return job_from_proto(response.job, response.progress if response.HasField("progress") else None)

    async def get_jobs(
        self, jobs: Iterable[JobLike], *, timeout_s: float | None = None
    ) -> dict[str, Job | AsyncInferClientError]:
        """Many jobs as they stand now, in calls of up to 1,000 IDs (GetJobs): each job ID asked,
        in order, mapped to its Job or to the error for it (NotFoundError, as `get` raises). An
        answer that reached its size limit is asked for again, so every ID gets its job."""
        deadline = self._deadline(timeout_s)
        found: dict[str, Job | AsyncInferClientError] = {}
        pending = _job_ids(jobs)
        while pending:
            batch, pending = pending[:GET_JOBS_MAX_IDS], pending[GET_JOBS_MAX_IDS:]
            message = job_service_pb2.GetJobsRequest(job_ids=batch)

            async def invoke(
                remaining: float | None, message: job_service_pb2.GetJobsRequest = message
            ) -> job_service_pb2.GetJobsResponse:
                return await self._stub.GetJobs(message, timeout=remaining, metadata=self._metadata)

            again: list[str] = []
            for result in (await self._call(invoke, deadline)).results:
                if result.HasField("job"):
                    found[result.job_id] = job_from_proto(
                        result.job, result.progress if result.HasField("progress") else None
                    )
                elif result.error.reason == "ANSWER_FULL":
                    again.append(result.job_id)
                else:
                    error = error_from_proto(result.error)
                    found[result.job_id] = make_error(error.code, error.message, reason=error.reason)
            pending = again + pending
        return found

    async def models(self, *, timeout_s: float | None = None) -> list[ModelInfo]:
        """The models the gateway accepts jobs for, with their signatures and job defaults (kept as
        the cache that types submit's inputs and that create_batch checks its model against)."""
        models = await self._models(timeout_s, retry=True)
        self._remember_models(models)
        return models

    async def _models(self, timeout_s: float | None, *, retry: bool) -> list[ModelInfo]:
        message = job_service_pb2.ListModelsRequest()

        async def invoke(remaining: float | None) -> job_service_pb2.ListModelsResponse:
            return await self._stub.ListModels(message, timeout=remaining, metadata=self._metadata)

        return models_from_proto(await self._call(invoke, self._deadline(timeout_s), retry=retry))

    async def cancel(self, job: JobLike, *, reason: str = "", timeout_s: float | None = None) -> Job:
        """Cancels a queued or running job; returns it CANCELED, CANCELLING (running: it ends
        CANCELED), or in the terminal state it had already reached.

        Safe to repeat and to retry: the gateway refuses to cancel a finished job
        (FAILED_PRECONDITION JOB_ALREADY_FINISHED), and the SDK then returns the job as it is."""
        message = job_service_pb2.CancelJobRequest(job_id=_job_id(job), reason=reason)
        deadline = self._deadline(timeout_s)

        async def invoke(remaining: float | None) -> job_service_pb2.CancelJobResponse:
            return await self._stub.CancelJob(message, timeout=remaining, metadata=self._metadata)

        try:
            return job_from_proto((await self._call(invoke, deadline)).job)
        except FailedPreconditionError as error:
            if error.reason != "JOB_ALREADY_FINISHED":
                raise
        return await self.get(job, timeout_s=_unary_budget(deadline, self.timeout_s))

    def list(
        self,
        *,
        states: Iterable[JobState | str] = (),
        model: str = "",
        labels: Mapping[str, str] | None = None,
        page_size: int = 100,
        limit: int | None = None,
        timeout_s: float | None = None,
    ) -> JobListing:
        """The caller's jobs, newest first, filtered; pages are fetched as you iterate (each page
        is one call with its own `timeout_s`). `limit` stops after that many jobs. The listing's
        `unreadable_skipped` says how many the gateway left out, unreadable (JobListing)."""
        base = job_service_pb2.ListJobsRequest(
            page_size=page_size,
            states=[state_to_proto(_enum(JobState, s, "state")) for s in states],
            model_name=model,
            labels=dict(labels or {}),
        )

        async def page(token: str) -> job_service_pb2.ListJobsResponse:
            request = job_service_pb2.ListJobsRequest()
            request.CopyFrom(base)
            request.page_token = token

            async def invoke(remaining: float | None) -> job_service_pb2.ListJobsResponse:
                return await self._stub.ListJobs(request, timeout=remaining, metadata=self._metadata)

            return await self._call(invoke, self._deadline(timeout_s))

        return JobListing(page, limit=limit)
