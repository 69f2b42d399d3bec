"""The models SubmitJob accepts and ListModels shows: the gateway's configuration (the models and
versions it declares) plus the versions batchers have registered (asyncinfer.model_registry: the
models bucket, kept current by one ordered consumer, so nothing is read per request).

A model name is one the gateway's configuration declares, or one a batcher has registered that it
does not (a model loaded at runtime: learnt once a batcher serves it, with the signature announced
and the job defaults of a `[[models]]` table; remembered until the gateway stops, so that jobs can
still queue for it while no batcher serves it; a name only loading is not learnt yet). Its versions are those declared and those any batcher serves or loads now,
with the signature that batcher announced. A submit that names no version is validated against
the model's default version now (default_version, else the highest version served: the same rule
the scheduler applies at dispatch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import structlog

from asyncinfer.config import Config, ModelConfig, TensorSpecConfig, version_order
from asyncinfer.errors import FieldViolation, InvalidArgument, NotFound, unknown_model
from asyncinfer.model_registry import FAILED, LOADING, READY, UNAVAILABLE, RegisteredVersion, decode_registered
from asyncinfer.nats import JetStreamContext
from asyncinfer.nats.kv_watch import KeyUpdate, KeyWatch
from asyncinfer.tensors import TensorSpec

log = structlog.get_logger("asyncinfer.gateway.models")

_NO_LOADER = "asyncinfer.model_registry:registered"


@dataclass(frozen=True, slots=True)
class VersionListing:
    config: ModelConfig  # the version's signature and limits (declared, or as registered)
    state: str  # READY, LOADING or UNAVAILABLE
    reason: str
    batchers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModelListing:
    default: ModelConfig
    versions: tuple[VersionListing, ...]


def _spec_configs(specs: Iterable[TensorSpec]) -> tuple[TensorSpecConfig, ...]:
    return tuple(TensorSpecConfig(name=t.name, datatype=t.datatype, shape=t.shape) for t in specs)


class ModelCatalog:
    def __init__(self, config: Config, js: JetStreamContext | None = None) -> None:
        self._config = config
        self._entries: dict[str, RegisteredVersion] = {}
        # The same entries by model name, then key: every submit and each model of ListModels asks
        # for one model's entries, which a scan of them all made cost O(models x batchers) each
        # (ListModels quadratic: 100 ms for 300 models served by 12 batchers).
        self._by_model: dict[str, dict[str, RegisteredVersion]] = {}
        # Versions a batcher could not load, with why: shown by ListModels, never learnt from.
        self._failed: dict[str, RegisteredVersion] = {}
        # Model names no file declares, learnt from the registry: name -> its last registered table.
        self._learnt: dict[str, ModelConfig] = {}
        # Moves on with every update that may change what `listings` answers; not with a refresh
        # that rewrites an entry as it was (each batcher's every few seconds), so that a listing
        # can be kept until the next real change (JobService.ListModels).
        self.generation = 0
        self._watch = (
            KeyWatch(js, config.nats.models_bucket, self._on_update, name="model_catalog") if js is not None else None
        )

    async def start(self) -> None:
        if self._watch is not None:
            await self._watch.start()

    async def stop(self) -> None:
        if self._watch is not None:
            await self._watch.stop()

    def _on_update(self, update: KeyUpdate) -> None:
        if update.removed:
            self.generation += 1
            self._forget(update.key)
            self._failed.pop(update.key, None)
            return
        try:
            entry = decode_registered(update.value)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("model_registry_entry_unreadable", key=update.key, error=str(exc))
            return
        known = self._entries.get(update.key) or self._failed.get(update.key)
        if known is None or dataclasses.replace(known, updated_at=entry.updated_at) != entry:
            self.generation += 1
        if entry.state == FAILED:
            self._forget(update.key)
            self._failed[update.key] = entry
            return
        self._failed.pop(update.key, None)
        self._forget(update.key)  # a key holds one model's entry, but its value is what says which
        self._entries[update.key] = entry
        self._by_model.setdefault(entry.model_name, {})[update.key] = entry
        if self._config.model(entry.model_name) is None:
            self._learn(entry.model_name)

    def _forget(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        entries = self._by_model.get(entry.model_name)
        if entries is not None:
            entries.pop(key, None)
            if not entries:
                del self._by_model[entry.model_name]

    def _learn(self, name: str) -> None:
        """Remembers an undeclared model as its highest ready version. A name only loading is not
        learnt yet: a load that fails would otherwise leave a model that takes jobs and that no
        batcher ever served (they would wait for ever)."""
        ready = [e for e in self.registered(name) if e.signature is not None and e.state == READY]
        if not ready:
            return
        entry = max(ready, key=lambda e: version_order(e.version))
        assert entry.signature is not None
        try:
            model = ModelConfig(
                name=name,
                version=entry.version,
                # The gateway runs nothing (the loader is the batcher's): a placeholder passes the
                # torch backend's check, and is cleared below.
                loader=_NO_LOADER,
                inputs=_spec_configs(entry.signature.inputs),
                outputs=_spec_configs(entry.signature.outputs),
                **({"max_batch_size": entry.max_batch_size} if entry.max_batch_size else {}),
            ).model_copy(update={"loader": ""})
        except ValueError as exc:  # pydantic's ValidationError: a name or signature no table accepts
            log.error("model_registry_entry_refused", model=name[:64], error=str(exc))
            return
        if name not in self._learnt:
            log.info("model_learnt_from_registry", model=name, version=entry.version)
        self._learnt[name] = model

    def model(self, name: str) -> ModelConfig | None:
        """The model's table: declared in the file, or learnt from the registry."""
        return self._config.model(name) or self._learnt.get(name)

    def models(self) -> list[ModelConfig]:
        declared = {m.name for m in self._config.models}
        return list(self._config.models) + [m for n, m in sorted(self._learnt.items()) if n not in declared]

    def serves(self, model_name: str, version: str) -> bool:
        """Whether some batcher serves the version now (as registered)."""
        return any(e.version == version and e.state == READY for e in self.registered(model_name))

    def registered(self, model_name: str) -> list[RegisteredVersion]:
        return list(self._by_model.get(model_name, {}).values())

    def _registered_config(self, model: ModelConfig, version: str) -> ModelConfig | None:
        entry = next((e for e in self.registered(model.name) if e.version == version and e.signature), None)
        if entry is None or entry.signature is None:
            return None
        return model.model_copy(
            update={
                "version": version,
                "versions": (),
                "inputs": _spec_configs(entry.signature.inputs),
                "outputs": _spec_configs(entry.signature.outputs),
                "max_batch_size": entry.max_batch_size or model.max_batch_size,
            }
        )

    def version_config(self, model: ModelConfig, version: str) -> ModelConfig | None:
        return model.declared_version(version) or self._registered_config(model, version)

    def default_version(self, model: ModelConfig) -> str:
        ready = {e.version for e in self.registered(model.name) if e.state == READY}
        return model.default_among(ready)

    def resolve(self, name: str, version: str) -> ModelConfig:
        """The version a submit runs on (empty: the default now), as a whole model config; raises
        InvalidArgument or NotFound."""
        if not name:
            raise InvalidArgument("model_name is required", [FieldViolation("model_name", "give the model to run")])
        model = self.model(name)
        if model is None:
            raise unknown_model(name, (m.name for m in self.models()), "the models served")
        chosen = version or self.default_version(model)
        config = self.version_config(model, chosen)
        if config is not None:
            return config
        if not version:  # a default that nothing declares nor serves: validate against the model's own table
            return model.version_configs()[0]
        known = ", ".join(self.versions(model))
        raise NotFound(
            f"model {name!r} has no version {version[:64]!r}; its versions are: {known}",
            reason="MODEL_VERSION_NOT_FOUND",
            metadata={"model": name, "version": version[:64], "known_versions": known},
        )

    def versions(self, model: ModelConfig) -> list[str]:
        declared = [c.version for c in model.version_configs()]
        registered = {e.version for e in self.registered(model.name)}
        return declared + sorted(registered - set(declared), key=version_order)

    def load_failed(self, model_name: str, version: str) -> bool:
        """Whether a batcher told to serve the version could not load it and none serves or loads
        it now: ListModels' UNAVAILABLE with that reason, and a queued job's MODEL_LOAD_FAILED."""
        if any(e.version == version for e in self.registered(model_name)):  # READY or LOADING somewhere
            return False
        return any(e.model_name == model_name and e.version == version for e in self._failed.values())

    def _why_unavailable(self, model_name: str, version: str) -> str:
        """ "no batcher serves it", or why the batchers told to serve it could not (a model that
        failed to load left jobs waiting NO_WORKER with nothing that said so)."""
        failed = sorted(
            (e for e in self._failed.values() if e.model_name == model_name and e.version == version),
            key=lambda e: e.batcher_id,
        )
        if not failed:
            return "no batcher serves it"
        first = failed[0]
        more = f" (and {len(failed) - 1} more batchers)" if len(failed) > 1 else ""
        return f"batcher {first.batcher_id}{more} could not load it: {first.reason}"

    def listings(self) -> list[ModelListing]:
        listings = []
        for model in self.models():
            entries = self.registered(model.name)
            versions = []
            for version in self.versions(model):
                config = self.version_config(model, version)
                if config is None:
                    continue
                mine = [e for e in entries if e.version == version]
                ready = sorted(e.batcher_id for e in mine if e.state == READY)
                loading = sorted(e.batcher_id for e in mine if e.state == LOADING)
                if ready:
                    state, reason, batchers = READY, "", ready
                elif loading:
                    state, reason, batchers = (
                        LOADING,
                        "a batcher is loading and warming it up, or waits for its Triton server to answer",
                        loading,
                    )
                else:
                    state, reason, batchers = UNAVAILABLE, self._why_unavailable(model.name, version), []
                versions.append(VersionListing(config=config, state=state, reason=reason, batchers=tuple(batchers)))
            default = self.version_config(model, self.default_version(model)) or model.version_configs()[0]
            listings.append(ModelListing(default=default, versions=tuple(versions)))
        return listings
