"""What `up` adds to the configuration it was given (the shipped models, a development webhook
secret, its own batcher's key)."""

from __future__ import annotations

import os
from pathlib import Path

from asyncinfer.config import FLAKY_MODEL, MINILM_DOC_MODEL, MINILM_DOC_PIPELINE, MINILM_MODEL, Config
from asyncinfer.errors import ConfigError

# Where a receiver on this machine listens: what `up` on loopback lets webhooks reach.
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")


def dev_secret_file(config: Config) -> Path:
    """Where `up` keeps the webhook secret it generated: beside the JetStream store."""
    return Path(config.embedded_nats.store_dir).parent / "webhook-secret"


def with_up_defaults(config: Config) -> Config:
    """What `up` adds to the configuration it was given, so that the README's recipes run as they
    stand on a stack started without a file:

    - the models, when the file declares none: the sentence embedder `minilm-l6`, the document
      embedder `minilm-l6-doc` and the same as a pipeline, `minilm-l6-doc-pipeline`
      (asyncinfer.config.MINILM_MODEL, MINILM_DOC_MODEL, MINILM_DOC_PIPELINE), the demo model, and
      `flaky`, the sample model that fails on demand (asyncinfer.config.FLAKY_MODEL), for the
      dead-letter recipes;
    - a webhook signing secret for the default tenant, when no API keys are configured (so the
      gateway is on loopback, `check_up_exposure`) and that tenant has none: generated once and
      kept in `dev_secret_file` (mode 0600), so that it stays the same across restarts and a
      receiver can verify with it; the banner prints it. With API keys, secrets are the
      operator's to configure;
    - webhooks to loopback (a receiver on this machine), under the same condition (no API keys,
      so the gateway is on loopback and every caller is already on this machine) and unless the
      file sets `webhooks.allowed_networks`: anywhere else a loopback URL is refused, which left
      the generated secret nothing to verify on a laptop;
    - with API keys, a key of role batcher for its own batcher (`with_own_batcher_key`);
    - its batcher moving claim-checked bytes itself (`batcher.claim_check_io`), unless the file
      says otherwise: off by default elsewhere because it gives a batcher NATS credentials, but
      `up`'s batcher runs in the process that holds them anyway, and a file batch's chunks then
      skip the work stream (docs/BATCHES.md);
    - its batcher not exiting for a hung model call (`batcher.exit_after_overrun_s` 0), unless the
      file sets it: it runs in `up`'s process, whose every service would stop with it, and nothing
      restarts `up`; the model stays stuck (it takes no work) until its call returns or `up` restarts.
    - the scheduler reading its embedded nats-server's monitoring port (`scheduler.nats_monitor_urls`,
      when the file sets none and `embedded_nats.monitor_port` is on): that server's own store
      limit (max_file_store; unset, what it chose at start from the free disk) is the one that
      refuses writes, and JetStream's API, which reports the account's, has none for `up`'s.

    - claim-check objects' bytes as files of `objects` beside its JetStream store
      (`nats.objects_directory`, made if missing), unless the file sets it (`""`: in the stream):
      every service of `up` runs on this host, so the directory is shared by construction, and
      nats-server then stores and serves only the objects' metas (an MLP file batch ran 5% faster,
      nats-server's CPU down two thirds: docs/BATCHES.md, "Objects' bytes in a directory").

    - its services giving up at once on a NATS they cannot reach (`nats.first_connect_wait_s` 0, 3
      tries), unless the file sets it: `up` starts its own nats-server and waits for it before them,
      so one they cannot reach is not coming (the default's 60 s wait is for a NATS started apart).

    What the file set is `model_fields_set`, which `Config.replace` keeps (so `up --dev-tls`'s
    changes do not make the file look as if it declared models)."""
    if "claim_check_io" not in config.batcher.model_fields_set:
        config = config.replace(batcher={"claim_check_io": True})
    if "exit_after_overrun_s" not in config.batcher.model_fields_set:
        config = config.replace(batcher={"exit_after_overrun_s": 0.0})
    if "first_connect_wait_s" not in config.nats.model_fields_set:
        config = config.replace(nats={"first_connect_wait_s": 0.0})
    embedded = config.embedded_nats
    if "objects_directory" not in config.nats.model_fields_set:
        directory = Path(embedded.store_dir).parent / "objects"
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot make {str(directory)!r} for the objects' bytes ({exc.strerror or exc}); "
                'set nats.objects_directory to a directory of your own, or to "" to keep them in NATS'
            ) from None
        config = config.replace(nats={"objects_directory": str(directory)})
    if "nats_monitor_urls" not in config.scheduler.model_fields_set and embedded.monitor_port:
        host = "127.0.0.1" if embedded.host in ("0.0.0.0", "::", "") else embedded.host
        host = f"[{host}]" if ":" in host else host
        config = config.replace(scheduler={"nats_monitor_urls": [f"http://{host}:{embedded.monitor_port}"]})
    if "models" not in config.model_fields_set:
        embedders = [MINILM_MODEL, MINILM_DOC_MODEL, MINILM_DOC_PIPELINE]
        config = config.replace(models=[*embedders, *config.models, FLAKY_MODEL])
    if config.gateway.api_keys and not (config.batcher.api_key or config.batcher.api_key_file):
        config = with_own_batcher_key(config)
    tenant = config.gateway.default_tenant
    if not config.gateway.api_keys and config.webhooks.secret_for(tenant) is None:
        from asyncinfer.webhook_secrets import new_secret

        path = dev_secret_file(config)
        secret = read_dev_secret(path)
        if not secret:
            secret = new_secret()
            path.parent.mkdir(parents=True, exist_ok=True)
            write_private(path, secret + "\n")
        secrets = [entry.model_dump() for entry in config.webhooks.secrets]
        config = config.replace(webhooks={"secrets": [*secrets, {"tenant": tenant, "secret": secret}]})
    if not config.gateway.api_keys and "allowed_networks" not in config.webhooks.model_fields_set:
        config = config.replace(webhooks={"allowed_networks": list(LOOPBACK_NETWORKS)})
    return config


def read_dev_secret(path: Path) -> str:
    """The secret an earlier `up` generated ("" when there is none), or ConfigError naming the
    file when it holds no secret: edited, or cut short by a full disk, it ended `up` in pydantic's
    traceback (the bad value printed in it). It is not replaced silently: a receiver may have been
    given what was there."""
    from pydantic import ValidationError

    from asyncinfer.config import WebhookSecretConfig

    try:
        secret = path.read_text().strip() if path.exists() else ""
        if secret:
            WebhookSecretConfig(tenant="default", secret=secret)
    except (OSError, UnicodeDecodeError, ValidationError) as exc:
        why = exc.errors()[0]["msg"].removeprefix("Value error, ") if isinstance(exc, ValidationError) else str(exc)
        raise ConfigError(
            f"{path}, the webhook secret an earlier `asyncinfer up` generated, holds no secret ({why}): delete it "
            "for `up` to generate a new one (and give that to your receivers), or write a secret in it "
            "(`asyncinfer webhook-secret` prints one)"
        ) from None
    return secret


def write_private(path: Path, text: str) -> None:
    """Writes `text` to `path`, readable by its owner only: a new 0600 file beside it, renamed over
    it. A file already there keeps its mode when written in place (`touch(mode=0o600)` sets a mode
    only on the files it creates), so a secret written into an empty 0644 file was world-readable."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.new")
    temporary.unlink(missing_ok=True)  # left by a crash of a process with the same pid
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def with_own_batcher_key(config: Config) -> Config:
    """With API keys, the scheduler takes only batchers with a key of role batcher: `up` makes one
    for its own batcher, for this run only (its hash joins the key list; nothing is written)."""
    import secrets

    from asyncinfer.api_keys import hash_key

    key = secrets.token_urlsafe(32)
    keys = [entry.model_dump() for entry in config.gateway.api_keys]
    own = {"role": "batcher", "sha256": hash_key(key), "name": "asyncinfer up's batcher"}
    return config.replace(gateway={"api_keys": [*keys, own]}, batcher={"api_key": key})
