"""asyncinfer services: gateway, scheduler and batcher. Each imports only asyncinfer (shared) and
its own package, never another service's internals."""
