"""The `serve run` builder: Ray Serve LLM's OpenAI app, each model with its PLE offload.

Args are Ray Serve LLM's own (`llm_configs: [LLMConfig fields...]`) plus one `ple:` block per
model. Everything is validated here, in the controller's build task, so a bad config is one
clear error before any replica, actor or segment exists.
"""

from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError
from ray.serve import Application

from ray_ple.base import Frozen
from ray_ple.checkpoints.source import resolve
from ray_ple.config import PleConfig, validation_message
from ray_ple.engine_plan import OffloadPlan, plan_offload, slot_tokens
from ray_ple.errors import PleConfigError
from ray_ple.log import log_event
from ray_ple.serve.node_init import CALLBACK_CLS
from ray_ple.serve.server_plan import ServerPlan

SERVER_CLS = "ray_ple.serve.server:PleLLMServer"


class PleAppArgs(Frozen):
    """`args:` of the application: Ray Serve LLM's serving args, `ple:` inside each model."""

    llm_configs: list[dict[str, Any]] = Field(min_length=1)
    ingress_deployment_config: dict[str, Any] | None = None


def app_args(args: PleAppArgs | dict[str, Any]) -> PleAppArgs:
    """The application's `args:`, or one `PleConfigError` naming each offending key."""
    if isinstance(args, PleAppArgs):
        return args
    try:
        return PleAppArgs.model_validate(args)
    except ValidationError as exc:
        raise PleConfigError(validation_message("args", exc)) from None


def parse_entry(entry: dict[str, Any], index: int) -> tuple[Any, PleConfig]:
    """One model's `LLMConfig` and `ple:` block; bad keys are one `PleConfigError` each."""
    from ray.serve.llm import LLMConfig

    entry = dict(entry)
    where = f"llm_configs[{index}]"
    try:
        ple = PleConfig.model_validate(entry.pop("ple", {}) or {})
    except ValidationError as exc:
        raise PleConfigError(validation_message(f"{where}.ple", exc)) from None
    try:
        return LLMConfig.model_validate(entry), ple
    except ValidationError as exc:
        raise PleConfigError(validation_message(where, exc)) from None


def _offload_bundles(llm: Any, ple: PleConfig, world_size: int) -> dict[str, Any]:
    """Each worker's bundle also reserves its offload actor's CPUs (same bundle, same node)."""
    pgc = dict(llm.placement_group_config or {})
    kind = llm.accelerator_config.kind
    base = pgc.get("bundle_per_worker")
    bundles = pgc.get("bundles")
    if bundles is not None:
        if len(bundles) != world_size:
            raise PleConfigError(f"placement_group_config.bundles has {len(bundles)} bundles for "
                                 f"{world_size} engine workers; give one per worker")
        out = [dict(b) for b in bundles]
    else:
        base = dict(base or ({"CPU": 1} if kind == "cpu" else {"GPU": 1}))
        out = [dict(base) for _ in range(world_size)]
    for b in out:
        b["CPU"] = float(b.get("CPU", 0)) + ple.offload_num_cpus
    return {"bundles": out, "strategy": pgc.get("strategy", "STRICT_PACK")}


def _transport(llm: Any, ple: PleConfig) -> str:
    kind = llm.accelerator_config.kind
    if kind not in ("cpu", "gpu"):
        raise PleConfigError(f"PLE offload runs on CPU or GPU engines, not {kind}")
    transport = ple.transport if ple.transport != "auto" else ("cpu" if kind == "cpu" else "cuda")
    if (transport == "cuda") != (kind == "gpu"):
        raise PleConfigError(f"transport {transport!r} does not fit a {kind} engine")
    return transport


def _check_server_cls(llm: Any) -> None:
    """`server_cls` may be left out, or be `PleLLMServer` or a subclass of it (Ray Serve LLM
    has already turned a dotted path into the class; compared by name, so that checking a
    manifest never imports the server)."""
    cls = llm.server_cls
    if cls is None:
        return
    names = {f"{c.__module__}:{c.__qualname__}" for c in getattr(cls, "__mro__", ())}
    if SERVER_CLS not in names:
        raise PleConfigError(f"server_cls must be {SERVER_CLS} or a subclass of it when "
                             f"ple.enabled is true; got {cls!r}")


def validate_args(args: PleAppArgs | dict[str, Any]) -> list[tuple[Any, PleConfig]]:
    """Each model's `LLMConfig` (placed as `build_app` places it) and `ple:` block.

    Reads no checkpoint: KubeRay manifests are checked where the checkpoint does not exist.
    Everything else `build_app` would reject is one clear error here as well.
    """
    from ray.serve.llm import LLMConfig

    out = []
    for i, entry in enumerate(app_args(args).llm_configs):
        llm, ple = parse_entry(entry, i)
        if ple.enabled:
            _transport(llm, ple)
            slot_tokens(ple, llm.engine_kwargs)
            _check_server_cls(llm)
            world_size = int(llm.engine_kwargs.get("tensor_parallel_size", 1))
            llm = LLMConfig.model_validate({
                **llm.model_dump(exclude_unset=True),
                "placement_group_config": _offload_bundles(llm, ple, world_size)})
        llm.get_engine_config()  # unknown engine arguments fail here
        out.append((llm, ple))
    return out


def application_env_vars() -> dict[str, str]:
    """The application's `runtime_env.env_vars` (the build task runs in it; none outside Ray).

    Ray Serve LLM merges a model's `runtime_env` over the application's one key at a time, so
    the `env_vars` ray-ple sets would otherwise drop the user's (e.g. `VLLM_CPU_KVCACHE_SPACE`)
    from the offloaded replica alone.
    """
    import ray

    if not ray.is_initialized():
        return {}
    return dict((ray.get_runtime_context().runtime_env or {}).get("env_vars") or {})


def engine_env_vars(fields: dict[str, Any], model_env: dict[str, str],
                    ours: dict[str, str], app_env: dict[str, str] | None = None) -> dict[str, str]:
    """The offloaded replica's env vars: the application's, then the deployment's
    `ray_actor_options`, then the model's `runtime_env`, then ray-ple's own, each layer over
    the last (what a plain replica gets, plus ours); a user value ray-ple must set otherwise
    is refused."""
    actor_opts = (fields.get("deployment_config") or {}).get("ray_actor_options") or {}
    app = application_env_vars() if app_env is None else app_env
    user = {**app,
            **((actor_opts.get("runtime_env") or {}).get("env_vars") or {}), **model_env}
    clash = {k: v for k, v in user.items() if k in ours and str(v) != ours[k]}
    if clash:
        raise PleConfigError(f"env vars {clash} conflict with PLE offload, which sets "
                             f"{ {k: ours[k] for k in clash} }")
    return {**user, **ours}


@dataclass(frozen=True)
class CheckedModel:
    """One model exactly as `build_app` hands it to Ray Serve LLM, and how it was planned."""

    llm: Any  # the final LLMConfig
    ple: PleConfig
    checkpoint_dir: str
    transport: str | None = None  # None: served without the offload (`ple.enabled: false`)
    plan: OffloadPlan | None = None


def check_model(entry: dict[str, Any], index: int, app_env: dict[str, str]) -> CheckedModel:
    """Everything `build_app` validates for one model (the `ple:` block, the refusals, the
    engine settings, the checkpoint's config), without Ray running: `ray-ple check` calls it
    too, so a config it passes is one `build_app` accepts and its errors are the same text.

    `app_env` is the application's `runtime_env.env_vars` (what the build task runs in).
    """
    from ray.serve.llm import LLMConfig

    llm, ple = parse_entry(entry, index)
    mlc = llm.model_loading_config
    source = mlc.model_source or mlc.model_id
    checkpoint = resolve(source)
    fields = llm.model_dump(exclude_unset=True)
    fields["model_loading_config"] = {**fields.get("model_loading_config", {}),
                                      "model_source": checkpoint}
    if not ple.enabled:
        return CheckedModel(llm=LLMConfig.model_validate(fields), ple=ple,
                            checkpoint_dir=checkpoint)
    transport = _transport(llm, ple)
    plan = plan_offload(checkpoint, ple, llm.engine_kwargs, transport)
    _check_server_cls(llm)
    runtime_env = dict(fields.get("runtime_env") or {})
    runtime_env["env_vars"] = engine_env_vars(fields, runtime_env.get("env_vars") or {},
                                              plan.env, app_env)
    server_plan = ServerPlan(ple=ple, model_source=source, checkpoint_dir=checkpoint,
                             transport=transport, world_size=plan.world_size,
                             geometry=plan.geometry, sources=plan.sources)
    if "callback_config" not in fields:  # the user's own callback runs as they wrote it
        fields["callback_config"] = {"callback_class": CALLBACK_CLS}
    fields.update(
        engine_kwargs=plan.engine_kwargs,
        runtime_env=runtime_env,
        server_cls=llm.server_cls or SERVER_CLS,
        placement_group_config=_offload_bundles(llm, ple, plan.world_size),
        experimental_configs={**(fields.get("experimental_configs") or {}),
                              **server_plan.to_experimental()},
    )
    return CheckedModel(llm=LLMConfig.model_validate(fields), ple=ple, checkpoint_dir=checkpoint,
                        transport=transport, plan=plan)


def check_app(args: PleAppArgs | dict[str, Any],
              app_env: dict[str, str]) -> tuple[PleAppArgs, list[CheckedModel]]:
    """The application's args and each model as `build_app` builds them; one clear error
    (`PleConfigError`, or `PleModelError` for the checkpoint) for the first bad one."""
    args = app_args(args)
    return args, [check_model(e, i, app_env) for i, e in enumerate(args.llm_configs)]


def offload_llm_config(entry: dict[str, Any], index: int = 0) -> Any:
    """One model's LLMConfig with the offload wired in (or plain, when `ple.enabled: false`)."""
    return _logged(check_model(entry, index, application_env_vars()))


def _logged(m: CheckedModel) -> Any:
    mlc = m.llm.model_loading_config
    if m.plan is None:
        log_event("build_model", model_id=mlc.model_id, offload=False)
    else:
        log_event("build_model", model_id=mlc.model_id, offload=True, transport=m.transport,
                  world_size=m.plan.world_size, max_tokens=m.plan.geometry.max_tokens,
                  table_bytes=sum(g.table_bytes for g in m.plan.geometry.tables))
    return m.llm


def build_app(args: PleAppArgs) -> Application:
    """`import_path: ray_ple.serve:build_app`; returns Ray Serve LLM's OpenAI application."""
    from ray.serve.llm import build_openai_app

    args, models = check_app(args, application_env_vars())
    serving: dict[str, Any] = {"llm_configs": [_logged(m) for m in models]}
    if args.ingress_deployment_config is not None:
        serving["ingress_deployment_config"] = args.ingress_deployment_config
    return build_openai_app(serving)
