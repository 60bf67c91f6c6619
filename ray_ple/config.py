"""The `ple:` block of a serve config: one pydantic model, unknown keys rejected."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from ray_ple.base import Frozen
from ray_ple.errors import PleConfigError

HugePages = Literal["auto", "off", "require"]

# Every key of the `ple:` block is taken as written: strict types (no bool for a count or a
# flag from "true"/1, no "1" or 1.0 for a count; an int is a valid float), and no inf or nan
# (`heartbeat_s: .inf` would turn liveness off, `step_s: .inf` overflows the nanosecond clock).
_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

# Upper bounds of the deadlines: each is a promise that a stuck replica ends, so none may be
# so long that it never does. A day covers any table load + engine start + compile on a slow
# node; an hour covers any one forward (a long prefill on a CPU engine takes minutes) and any
# flag wait or heartbeat gap of a live side.
_DAY_S, _HOUR_S = 86400.0, 3600.0
# Floors: a look or a beat more often than every millisecond only spins a core, and a
# deadline under 10 ms (startup: 100 ms) is shorter than a scheduler's time slice.
_MS = 0.001
# Slot rows: 256 Ki tokens in one forward is past any engine's max_num_batched_tokens, and
# E4B's slots for it would take 5.6 GB of page-locked memory in every worker.
MAX_TOKENS = 1 << 18


class PleDeadlines(Frozen):
    """Progress deadlines; missing one ends the replica (`docs/design-notes.md#supervision`)."""

    model_config = _STRICT
    startup_s: float = Field(900.0, ge=0.1, le=_DAY_S,
                             description="table load + engine start + graph capture")
    step_s: float = Field(60.0, ge=0.01, le=_HOUR_S,
                          description="a posted step is released within this (plus "
                          "step_token_s a token), or the replica ends")
    step_token_s: float = Field(0.02, ge=0, le=1.0,
                                description="added to step_s per token of the step, so a "
                                "long prefill on a slow CPU engine is not a stuck step: an "
                                "8,192-token prefill has 224 s, a decode step 60")
    offload_wait_s: float = Field(10.0, ge=0.01, le=_HOUR_S,
                                  description="the offload actor's longest wait for the "
                                  "worker to release a slot")
    heartbeat_s: float = Field(5.0, ge=0.01, le=_HOUR_S,
                               description="a side whose heartbeat is older is dead (the "
                               "supervisor's intervals are at most half of it)")


class SupervisorConfig(Frozen):
    """How often the supervisor looks; detection latency is bounded by these. Advanced: tests
    set them to place a fault; a served model keeps the defaults."""

    model_config = _STRICT
    poll_interval_s: float = Field(0.02, ge=_MS, le=5, description="advanced: how often the "
                                   "supervisor reads each pair's counters")
    heartbeat_interval_s: float = Field(0.25, ge=_MS, le=5, description="advanced: how often "
                                        "each side beats")


class PleConfig(Frozen):
    """Per-deployment PLE offload settings (the `ple:` block)."""

    model_config = _STRICT
    enabled: bool = Field(True, description="false serves the same model unoffloaded, the "
                          "table on the accelerator (the reference, and the way to serve what "
                          "the offload refuses)")
    transport: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cpu (vLLM-CPU engines) or cuda (GPU engines); auto: cuda where "
        "the engine has GPUs, else cpu"
    )
    post: Literal["auto", "host", "stream"] = Field(
        "auto", description="advanced: who posts a step (benchmarks compare the two): the "
        "host before the forward (needs the ids on the host, so vLLM's async scheduling is "
        "turned off on CUDA), or the GPU stream itself "
        "(a kernel before the forward reads the model's input ids; the host never waits and "
        "async scheduling stays as configured; the offload actor spins from the announcement "
        "to the post). auto: stream where vLLM runs the cuda transport with async scheduling "
        "(its default), host otherwise (a synchronous engine would pay the stream post's host "
        "time before each launch)"
    )
    offload_num_cpus: float = Field(1.0, ge=0, description="CPUs each offload actor reserves, "
                                    "added to its worker's bundle")
    gather_threads: int = Field(1, ge=1, le=64, description="threads an offload actor gathers "
                                "a large step with")
    parts: (Annotated[int, Field(ge=1, le=128)] | Literal["auto"]
            | Annotated[tuple[Annotated[int, Field(ge=1)], ...],
                        Field(min_length=1, max_length=128)]) = Field(
        "auto", description="slots per table row, each of consecutive layers with its own "
        "flag, waited for at its first layer (late waits), covering the offloaded layers (the "
        "model's, less `resident_layers`): n parts as even as can be, or (advanced) a list of "
        "layers per part in order (adding up to the offloaded layers); auto: one part up to 6 "
        "layers, above parts of 1, 2, 4, ... layers and the rest (E4B: 1, 2, 4, 8 and 26 "
        "layers on cuda, 27 last on cpu); 1: all of them at once"
    )
    resident_layers: Annotated[int, Field(ge=0, le=128)] | Literal["auto"] = Field(
        "auto", description="first layers whose PLE columns the worker keeps in its own "
        "(device) memory, looked up there as vLLM looks up its table and never posted, so no "
        "gather, copy or wait is on layer 0's gate (E4B: 134 MB a layer, of the 5.25 GiB "
        "table); the rest of the row is offloaded in `parts`. Gemma 4 only (late waits). "
        "auto: 1 on the cuda transport (decode steps then never wait for the first part: "
        "bench/README.md, layer 0 resident), 0 on cpu, for Gemma 3n and for a one-layer model"
    )
    offload_spin_us: float = Field(
        0.0, ge=0, le=1e6, description="advanced: the offload actor spins this long on "
        "`posted` before it blocks on the doorbell (GPU decode latency; costs a core while it "
        "spins)"
    )
    shm_dir: str = Field("/dev/shm", description="tmpfs for the slots and the node's table "
                         "copy; its free space is checked at setup")
    huge_pages: HugePages = Field(
        "auto", description="the node table (a 4 KiB header page + the rows, rounded up to "
        "whole pages) on the host's hugetlb pool (2 MiB pages: a pod's hugepages-2Mi, or "
        "vm.nr_hugepages): auto where the pool holds it, else 4 KiB shmem pages; off: 4 KiB "
        "pages; require: a pool too small is one error at setup. The holder that loads the "
        "node's copy decides; later holders map that copy as it is (require refuses 4 KiB). "
        "Random rows then cost fewer page walks (bench/cpu/probe_hugetlb.py)"
    )
    table_tensor: str | None = Field(
        None, description="checkpoint tensor of the PLE table; found by name when unset"
    )
    max_tokens: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="slot rows, the most tokens a step may have; "
        "unset: the engine's max_num_batched_tokens (8192 when that is unset too)"
    )
    deadlines: PleDeadlines = PleDeadlines()
    supervisor: SupervisorConfig = SupervisorConfig()

    @field_validator("parts", mode="before")
    @classmethod
    def _parts_as_written(cls, v: Any) -> Any:
        """One message for a bad `parts` (not one per branch of the union), and no bool or
        numeric string taken for a count: a part count is a layout, not a guess."""
        if v == "auto" or (type(v) is int and 1 <= v <= 128):
            return v
        if (isinstance(v, (list, tuple)) and 1 <= len(v) <= 128
                and all(type(x) is int and x >= 1 for x in v)):
            return tuple(v)
        raise ValueError(f"ple.parts={v!r}: 'auto', a count of parts 1..128, or a list of 1..128 "
                         "layer counts (each >= 1), one per part in layer order")

    @field_validator("resident_layers", mode="before")
    @classmethod
    def _resident_as_written(cls, v: Any) -> Any:
        if v == "auto" or (type(v) is int and 0 <= v <= 128):
            return v
        raise ValueError(f"ple.resident_layers={v!r}: 'auto' or a count of layers 0..128")

    @model_validator(mode="after")
    def _consistent(self) -> PleConfig:
        if not self.shm_dir.startswith("/"):
            raise ValueError(f"ple.shm_dir must be an absolute path, got {self.shm_dir!r}")
        beat, dead = self.supervisor.heartbeat_interval_s, self.deadlines.heartbeat_s
        if beat * 2 > dead:
            raise ValueError(f"supervisor.heartbeat_interval_s={beat:g} must be at most half of "
                             f"deadlines.heartbeat_s={dead:g}: a side beating less often than "
                             "that is declared dead while idle")
        if self.supervisor.poll_interval_s * 2 > dead:
            raise ValueError(f"supervisor.poll_interval_s={self.supervisor.poll_interval_s:g} "
                             f"must be at most half of deadlines.heartbeat_s={dead:g}")
        return self


def parse_ple(raw: PleConfig | Mapping[str, Any] | None) -> PleConfig:
    """The `ple:` block, or one `PleConfigError` naming each offending key."""
    if isinstance(raw, PleConfig):
        return raw
    try:
        return PleConfig.model_validate(raw or {})
    except ValidationError as exc:
        raise PleConfigError(validation_message("ple", exc)) from None


def validation_message(where: str, exc: ValidationError) -> str:
    """pydantic's errors as one line per offending key, named as the user wrote it."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in (where, *err["loc"]))
        lines.append(f"{key}: {err['msg']} (got {err.get('input')!r})"[:300])
    return "invalid configuration: " + "; ".join(lines)
