"""The gateway: the public JobService (validation, job records' creation, watches)."""
