"""The models the project ships: the demo model, `flaky`, and the MiniLM embedders `up` serves."""

from __future__ import annotations

from asyncinfer.config.models import ModelConfig, PipelineStepConfig, TensorSpecConfig

DEMO_MODEL = ModelConfig(
    name="demo",
    version="1",
    loader="services.batcher.models.demo:build_demo_model",
    max_batch_size=32,
    max_queue_delay_ms=2.0,
    inputs=(TensorSpecConfig(name="x", datatype="FP32", shape=(-1, 4)),),
    outputs=(TensorSpecConfig(name="y", datatype="FP32", shape=(-1, 4)),),
)
# The sample model that fails on demand, served by `asyncinfer up` beside the demo model when its
# file declares no models (so that the dead-letter recipes have something to act on): the demo's
# signature and y = 2x + 1, but a job whose x has a row starting with a negative number fails with
# MODEL_ERROR (retriable) on each of its 2 attempts, 0.2 s apart, and is dead-lettered in about a
# second.
FLAKY_MODEL = ModelConfig.model_validate(
    {
        **DEMO_MODEL.model_dump(),
        "name": "flaky",
        "loader": "services.batcher.models.demo:build_flaky_model",
        "max_attempts": 2,
        "retry_backoff_base_s": 0.2,
        "retry_backoff_max_s": 1.0,
    }
)

# The built-in text embedders (services/batcher/backends/minilm.py and minilm_doc.py), declared
# here without torch so that `asyncinfer up` (services/up/defaults.py with_up_defaults) can serve them
# beside the demo model: all-MiniLM-L6-v2 on sentences, and the same model on long documents.
MINILM_EMBEDDING_DIM = 384
MINILM_MODEL = ModelConfig(
    name="minilm-l6",
    loader="builtin:minilm-l6",
    max_batch_size=64,
    max_queue_delay_ms=5.0,
    cost="tokens",
    max_batch_cost=4096,
    inputs=(TensorSpecConfig(name="text", datatype="BYTES", shape=(-1,)),),
    outputs=(TensorSpecConfig(name="embedding", datatype="FP32", shape=(-1, MINILM_EMBEDDING_DIM)),),
)
MINILM_DOC_MODEL = ModelConfig(
    name="minilm-l6-doc",
    loader="builtin:minilm-l6-doc",
    max_batch_size=8,
    max_queue_delay_ms=5.0,
    cost="tokens",
    max_batch_cost=65536,
    length_buckets=(256, 1024, 4096, 16384),
    default_execution_timeout_s=600.0,
    inputs=(TensorSpecConfig(name="text", datatype="BYTES", shape=(-1,)),),
    outputs=(TensorSpecConfig(name="embedding", datatype="FP32", shape=(-1, MINILM_EMBEDDING_DIM)),),
)
# minilm-l6-doc as a pipeline (ModelConfig.steps): documents cut into windows, the windows embedded
# by minilm-l6 in its own batches (with the windows of other jobs, and minilm-l6's own jobs), the
# windows' embeddings pooled per document (services/batcher/models/doc_pipeline.py).
MINILM_DOC_PIPELINE = ModelConfig(
    name="minilm-l6-doc-pipeline",
    max_batch_size=8,
    default_execution_timeout_s=600.0,
    inputs=(TensorSpecConfig(name="text", datatype="BYTES", shape=(-1,)),),
    outputs=(TensorSpecConfig(name="embedding", datatype="FP32", shape=(-1, MINILM_EMBEDDING_DIM)),),
    steps=(
        PipelineStepConfig(
            name="chunk",
            function="services.batcher.models.doc_pipeline:chunk",
            inputs={"text": "text"},
            outputs={"windows": "windows", "document": "document"},
        ),
        PipelineStepConfig(model="minilm-l6", inputs={"text": "windows"}, outputs={"embedding": "window_embeddings"}),
        PipelineStepConfig(
            name="pool",
            function="services.batcher.models.doc_pipeline:pool",
            inputs={"embeddings": "window_embeddings", "document": "document"},
            outputs={"embedding": "embedding"},
        ),
    ),
)
