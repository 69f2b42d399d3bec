"""The scheduler: owns the work queues, dispatches jobs to batchers against their credits, keeps
leases alive, stores results, and serves WorkerService (batchers) and OpsService (operators)."""
