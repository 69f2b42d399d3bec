"""The batcher: per-model dynamic batching in front of model backends, fed by the scheduler's
WorkerService stream and serving the KServe v2 GRPCInferenceService for synchronous calls."""
