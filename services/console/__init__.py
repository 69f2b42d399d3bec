"""The web console: server-rendered pages of the models, the queues (live, with plots of the last
minutes), a tenant's jobs, a job's page and the dead letters, over the gateway's JobService and
the scheduler's OpsService only (their public gRPC APIs, with the keys it is configured with:
asyncinfer.config.ConsoleConfig). `asyncinfer up` starts one and prints its URL; `asyncinfer
console --config FILE` runs one alone (on Kubernetes: deploy/k8s/base/console.yaml).

- backend.py: the two gRPC channels, protobuf turned into the SDK's types and small dataclasses;
- history.py: the queue samples behind the plots (memory only);
- html.py: escaping, the page frame, tables, forms and the inline-SVG plots, no template engine;
- pages_jobs.py, pages_ops.py: the pages; context.py: what they share; app.py: the aiohttp app.
"""
