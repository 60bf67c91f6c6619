"""Gemma 4 (text) whose per-layer-embedding lookup is offloaded to the offload actor, each
layer getting its PLE rows just before it consumes them.

The table is never allocated in the worker: vLLM builds `Gemma4Model.embed_tokens_per_layer`
as a `VocabParallelEmbedding` sized by `vocab_size_per_layer_input`, so construction sees a
one-row placeholder table (the config attribute is restored at once, and the model's own id
bound is put back), then the placeholder is replaced by `PleOffloadEmbedding` (vLLM's own
path, for prompt embeddings); the checkpoint's table weights are skipped at load.

vLLM 0.32's `Gemma4Model.forward` builds every layer's per-layer input before the layer loop
(`get_per_layer_inputs`, then `project_per_layer_inputs`: `(norm(proj) + ple * es) * s`), so
an offloaded lookup would have to be complete before layer 0. Yet layer l reads its slice only
at its end (the PLE gate, after attention and MLP). This model runs the projection matmul up
front and moves the rest of the combine of layer l to layer l's gate:

    projection = proj(embeds) * ps, as [T, L, d]            # vLLM's steps 1-3, up front
    layer l:  attention, MLP (vLLM's code)                  # the offload side gathers meanwhile
              if l is the first layer of its part p:        # the wait for p's rows
                  c_p = (norm(projection[:, p]) + rows_p * es) * s   # vLLM's steps 4-5, p's layers
                  settle(c_p)                               # stored in bf16, as vLLM's is
                                                            # (a marker: eager CPU skips it)
              PLE gate with c_p[:, l], layer scalar (vLLM's code)

Each part is one slot of the pair (`ple.parts`, `PleGeometry.slots`: consecutive layers, one
flag each, raised by the offload side as soon as its rows are written). Every part's pull is
started right after the projection (`ray_ple::pull_async`: on CUDA the side stream waits for
the flag and copies while the layers run; on CPU nothing yet) and joined at the gate of its
first layer (`ray_ple::pull_wait(out, after, slot)`: the model stream waits for the copy; on
CPU the engine thread waits for the flag and copies, eagerly through the op's kernel itself,
`ray_ple.worker.ops.eager_on_cpu`). `after` is that gate's matmul output,
so that no compiler can hoist the join above the layers it is meant to overlap. Under
piecewise CUDA graphs (vLLM's mode for mixed prefill batches) a fork captured in one piece
cannot be joined in another, so there each part is waited for and copied in the piece of
its first layer (`ray_ple.worker.ops`). With one part (`ple.parts: 1`) the whole offloaded
row is joined at its first layer's gate.

Resident layers (`ple.resident_layers`, `PleGeometry.resident_layers`; auto: 1 on CUDA): the
first layers' columns of the checkpoint's table are kept by this model (`resident_table`,
taken from the table tensor at load, the rest of it dropped) and looked up with the step's
ids, mapped as vLLM maps them, before layer 0; the pair's slots start after them. That
puts no gather, copy or wait on layer 0's gate, the one gate the gather of the first part
cannot hide before at small steps (bench/cuda/bench_model.py, `--extra resident`). The
resident part is combined like any other.

Arithmetic: norm and combine are per row of d and elementwise, so computing them on a
part's slice of layers gives each element the same operations in the same order on the same
dtypes (the model's own norm, `embed_scale_per_layer` and bf16-rounded
`per_layer_input_scale`), in eager mode by construction. Compiled, Inductor decides what is
stored in bf16 and what stays fp32 inside a fused kernel: vLLM's graph stores the combined
input once (the norm fused in, fp32), so here what is kept across layers is the projection
matmul's bf16 output and each part's combined input, which `settle` makes a stored bf16
buffer before any gate reads it. Ids outside
`vocab_size_per_layer_input` map to row 0 on the offload side (its gather), as vLLM's
`torch.where` does. Refused: kv-sharing fast prefill (YOCO's split forward builds every
layer's input inside the self-decoder and copies it for the cross-decoder) and any vLLM
whose mirrored sources differ from those ray-ple was checked against (`mirror.MIRRORED`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from itertools import islice

import torch
from vllm.config import VllmConfig
from vllm.forward_context import in_piecewise_cudagraph
from vllm.model_executor.models import gemma4 as vllm_gemma4
from vllm.model_executor.models.gemma4 import (
    Gemma4DecoderLayer,
    Gemma4ForCausalLM,
    Gemma4Model,
    _get_text_config,
)

from ray_ple.engine_settings import PleEngineSettings
from ray_ple.errors import PleConfigError, PleModelError
from ray_ple.protocol.geometry import SlotGeometry
from ray_ple.worker import ops
from ray_ple.worker.vllm_plugin.attach import attach_worker
from ray_ple.worker.vllm_plugin.embedding import offload_embedding, without_table
from ray_ple.worker.vllm_plugin.mirror import check_mirrored

Weight = tuple[str, torch.Tensor]  # (checkpoint name, tensor), as vLLM loads them
PLE_WEIGHT = "embed_tokens_per_layer."  # in the name of the checkpoint's table


# `ray_ple::settle(Tensor(a!) x) -> ()`: does nothing, but a compiler must hand it `x` as a
# real buffer. vLLM's compiled graph stores every layer's combined input in bf16 before any
# gate reads it (CPU: one fused kernel; CUDA: it crosses piecewise-graph boundaries); without
# this, Inductor fuses the part's combine into the gate product and skips that bf16 rounding.
_LIB = torch.library.Library("ray_ple", "FRAGMENT")
_LIB.define("settle(Tensor(a!) x) -> ()")


def _settle(x: torch.Tensor) -> None:
    return None


for _key in ("CPU", "CUDA"):
    _LIB.impl("settle", _settle, _key)
torch.library.register_fake("ray_ple::settle", _settle, lib=_LIB)
ops.set_piecewise_probe(in_piecewise_cudagraph)


def _layer_forward(layer: Gemma4DecoderLayer, positions: torch.Tensor,
                        hidden_states: torch.Tensor, residual: torch.Tensor | None,
                        per_layer_input: Callable[[torch.Tensor], torch.Tensor] | None,
                        **kwargs: object) -> tuple[torch.Tensor, None]:
    """vLLM 0.32's `Gemma4DecoderLayer.forward`, its per-layer input asked for at the gate."""
    residual = hidden_states
    hidden_states = layer.input_layernorm(residual)
    hidden_states = layer.self_attn(positions=positions, hidden_states=hidden_states, **kwargs)
    hidden_states = layer.post_attention_layernorm(hidden_states)
    hidden_states = hidden_states + residual
    residual = hidden_states

    hidden_states = layer.pre_feedforward_layernorm(hidden_states)
    hidden_states = layer.mlp(hidden_states)

    if layer.enable_moe_block:
        hidden_states_1 = layer.post_feedforward_layernorm_1(hidden_states)
        hidden_states_2 = layer.pre_feedforward_layernorm_2(residual)
        router_logits = layer.router(residual)
        hidden_states_2 = layer.experts(hidden_states_2, router_logits)
        hidden_states_2 = layer.post_feedforward_layernorm_2(hidden_states_2)
        hidden_states = hidden_states_1 + hidden_states_2

    hidden_states = layer.post_feedforward_layernorm(hidden_states)
    hidden_states = hidden_states + residual

    if per_layer_input is not None and layer.per_layer_input_gate is not None:
        gate_mm = layer.per_layer_input_gate(hidden_states)
        gate = torch.nn.functional.gelu(gate_mm, approximate="tanh")
        gated_per_layer = gate * per_layer_input(gate_mm)  # the wait: l's rows, here
        per_layer_contribution = layer.per_layer_projection(gated_per_layer)
        per_layer_contribution = layer.post_per_layer_input_norm(per_layer_contribution)
        hidden_states = hidden_states + per_layer_contribution

    hidden_states = hidden_states * layer.layer_scalar
    return hidden_states, None


class PleOffloadGemma4Model(Gemma4Model):
    """`Gemma4Model` whose layer loop pulls and combines each part's PLE rows at its gate.

    A subclass of the compiled class: `@support_torch_compile` traces this `forward` (same
    signature, so the same dynamic dims); the pull op sits inside the traced graph, as
    today's does.
    """

    ple_parts: tuple[range, ...] = ()
    ple_part_of: tuple[int, ...] = ()  # layer -> its part (trace-time constants)
    # plain values, traced as constants; a name None is the resident part, looked up here
    ple_slot_names: tuple[str | None, ...] = ()
    ple_slot_elems: tuple[int, ...] = ()
    # vLLM's media class scales the rows before its language model runs (eager, a stored bf16
    # buffer); its text class scales them inside the compiled forward. Set by the media class.
    ple_scaled_rows_stored: bool = False

    def set_parts(self, slots: tuple[SlotGeometry, ...], resident_layers: int = 0) -> None:
        """The table's slots, in order, covering every layer from `resident_layers` on once
        (the engine's geometry); the first `resident_layers` are one part of this model's
        own, its columns of the table held in `resident_table` (filled by `load_resident`)."""
        d = self.hidden_size_per_layer_input
        parts = ((range(resident_layers),) if resident_layers else ()) + tuple(
            range(s.first_layer, s.first_layer + s.num_layers) for s in slots)
        if [i for r in parts for i in r] != list(range(self.config.num_hidden_layers)):
            raise PleConfigError(f"PLE parts {parts} do not cover the "
                                 f"{self.config.num_hidden_layers} layers in order")
        if any(s.row_elems != s.num_layers * d for s in slots):
            raise PleConfigError(f"PLE slots are not {d} values per layer")
        head = (None,) if resident_layers else ()
        self.ple_parts = parts
        self.ple_slot_names = head + tuple(s.name for s in slots)
        self.ple_slot_elems = (resident_layers * d,) * len(head) + tuple(
            s.row_elems for s in slots)
        self.ple_part_of = tuple(p for p, r in enumerate(parts) for _ in r)
        # on the model's device (vLLM builds the model under it); None without resident layers
        self.register_buffer("resident_table", torch.empty(
            (self.vocab_size_per_layer_input, resident_layers * d),
            dtype=self.embed_tokens_per_layer.dtype) if resident_layers else None,
            persistent=False)
        self.resident_loaded = False

    def load_resident(self, table: torch.Tensor) -> None:
        """Keep the checkpoint table's columns of the resident layers (vLLM's weight copy:
        `copy_`, in the engine dtype); the rest of the table is never kept here. The table
        must be the whole `rows x (layers * d)` one, and come once."""
        if self.resident_table is None:
            raise PleModelError("no resident PLE layers were configured")
        if self.resident_loaded:
            raise PleModelError("the checkpoint has a second PLE table: which one holds the "
                                "resident layers' columns is ambiguous")
        rows, cols = self.resident_table.shape
        whole = (rows, self.config.num_hidden_layers * self.hidden_size_per_layer_input)
        if tuple(table.shape) != whole:
            raise PleModelError(f"checkpoint PLE table {tuple(table.shape)} is not the "
                                f"{whole[0]} x {whole[1]} table the geometry describes")
        self.resident_table.copy_(table[:, :cols])
        self.resident_loaded = True

    def start_parts(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Every part's buffer of the step: the resident part looked up at once, then every
        offloaded part's pull started (joined by `combine`), the starts one after another."""
        if self.resident_table is not None and not self.resident_loaded:
            # a loader that never called `load_weights` (a dummy format) left it unwritten
            raise PleModelError("the resident PLE layers' columns were never loaded")
        t, device = input_ids.shape[0], input_ids.device
        dtype = self.embed_tokens_per_layer.dtype
        bufs = [self._resident_rows(input_ids) if name is None else
                torch.empty((t, elems), dtype=dtype, device=device)
                for name, elems in zip(self.ple_slot_names, self.ple_slot_elems, strict=True)]
        ops.start_parts([(name, buf) for name, buf in zip(self.ple_slot_names, bufs,
                                                          strict=True) if name is not None])
        return bufs

    def _resident_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The resident layers' rows, ids mapped as vLLM's `get_per_layer_inputs` maps them
        (outside `[0, vocab_size_per_layer_input)`: row 0)."""
        inside = torch.logical_and(input_ids >= 0, input_ids < self.vocab_size_per_layer_input)
        ids = torch.where(inside, input_ids, torch.zeros_like(input_ids))
        return torch.nn.functional.embedding(ids, self.resident_table)

    def _join_part(self, part: int, out: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        """`T x (len(part) * d)` raw rows of one part, waited for once `after` exists (the
        resident part: looked up already)."""
        name = self.ple_slot_names[part]
        return out if name is None else ops.join_part(name, out, after)

    def scaled_projection(self, inputs_embeds: torch.Tensor) -> torch.Tensor | None:
        """Steps 1-3 of vLLM's `project_per_layer_inputs`: `[T, L, d]`, not yet normed."""
        if self.per_layer_model_projection is None:
            return None
        dec = self.self_decoder
        per_layer_projection = dec.per_layer_model_projection(inputs_embeds)
        per_layer_projection = per_layer_projection * dec.per_layer_projection_scale
        return per_layer_projection.reshape(*inputs_embeds.shape[:-1],
                                            self.config.num_hidden_layers,
                                            self.hidden_size_per_layer_input)

    def combine(self, layer_idx: int, projection: torch.Tensor, after: torch.Tensor,
                parts: list[torch.Tensor], joined: set[int]) -> torch.Tensor:
        """Layer `layer_idx`'s `T x d` combined input; its part's, all layers at once, on the
        first ask (the part's wait), so a part costs one norm and one combine, as vLLM's
        whole table does, not one per layer."""
        part = self.ple_part_of[layer_idx]
        if part not in joined:
            joined.add(part)
            rows = self._join_part(part, parts[part], after)
            parts[part] = self._combine_part(part, projection, rows)
        return parts[part][:, layer_idx - self.ple_parts[part].start]

    def _combine_part(self, part: int, projection: torch.Tensor,
                      rows: torch.Tensor) -> torch.Tensor:
        """Steps 4-5 of vLLM's `project_per_layer_inputs` on one part's layers: `[T, n, d]`.

        The norm runs here, not up front, so that under piecewise graphs what crosses a
        graph boundary is the projection's matmul output and the settled combined part (both
        bf16 in vLLM's graph too), and the norm stays fused, in fp32, into the combine as in
        vLLM's kernel. Norm and combine are per row of d and elementwise: the part's slice
        gets each element's operations exactly as vLLM's whole `[T, L, d]` does.
        """
        dec = self.self_decoder
        layers = self.ple_parts[part]
        normed = dec.per_layer_projection_norm(projection[:, layers.start:layers.stop])
        ple = rows.unflatten(1, (len(layers), self.hidden_size_per_layer_input))
        ple = ple * dec.embed_scale_per_layer
        eager = ops.eager_on_cpu(ple)  # eager, every result is a stored buffer already
        if self.ple_scaled_rows_stored and not eager:
            torch.ops.ray_ple.settle(ple)
        combined = (normed + ple) * dec.per_layer_input_scale
        if not eager:
            torch.ops.ray_ple.settle(combined)
        return combined

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: object | None,
        inputs_embeds: torch.Tensor | None = None,
        per_layer_inputs: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        if input_ids is None or intermediate_tensors is not None:
            # no ids to pull for (prompt embeds) or not the first PP rank: vLLM's own path
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds,
                                   per_layer_inputs, **kwargs)
        # embeddings with ids: the media class's step (gemma4_media.py), media ids mapped to 0
        hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None \
            else inputs_embeds
        projection = self.scaled_projection(hidden_states)
        parts = self.start_parts(input_ids) if projection is not None else []
        joined: set[int] = set()
        residual = None
        aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, residual)
        for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer)):
            layer_idx = self.start_layer + idx

            def per_layer_input(after: torch.Tensor, layer_idx: int = layer_idx) -> torch.Tensor:
                return self.combine(layer_idx, projection, after, parts, joined)

            hidden_states, residual = _layer_forward(
                layer, positions, hidden_states, residual,
                per_layer_input if projection is not None else None, **kwargs)
            self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)
        if len(joined) != len(parts):  # a started pull no layer joined (decided when traced)
            raise PleModelError(f"PLE parts {sorted(set(range(len(parts))) - joined)} were "
                                "started but no layer's gate joined them")
        if residual is None:
            hidden_states = self.norm(hidden_states)
        else:
            hidden_states, _ = self.norm(hidden_states, residual)
        if len(aux_hidden_states) > 0:
            return hidden_states, aux_hidden_states
        return hidden_states


@contextmanager
def _model_class(cls: type[Gemma4Model]) -> Iterator[None]:
    """Let `Gemma4ForCausalLM.__init__` build `cls` as its `self.model` (construction only)."""
    saved = vllm_gemma4.Gemma4Model
    vllm_gemma4.Gemma4Model = cls
    try:
        yield
    finally:
        vllm_gemma4.Gemma4Model = saved


class RayPleGemma4ForCausalLM(Gemma4ForCausalLM):
    """Gemma 4 with its PLE table offloaded (`PleOffloadGemma4Model`): the offload class of
    Gemma 4 (registered as `ARCHITECTURES[...].offload_arch`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        check_mirrored("vllm.model_executor.models.gemma4")
        if vllm_config.cache_config.kv_sharing_fast_prefill:
            raise PleConfigError(
                "kv_sharing_fast_prefill is not supported with ray-ple's offloaded PLE: YOCO's "
                "split forward builds every layer's PLE input before the self-decoder runs")
        settings = PleEngineSettings.from_additional_config(vllm_config.additional_config)
        (table,) = settings.geometry.tables
        text = _get_text_config(vllm_config.model_config.hf_config)
        with _model_class(PleOffloadGemma4Model), without_table(text, table):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        # named inside the text model (the media class nests it under `language_model`)
        offload = offload_embedding(table, "model", vllm_config.model_config.dtype)
        model = self.model
        model.embed_tokens_per_layer = offload
        model.self_decoder.embed_tokens_per_layer = offload
        model.vocab_size_per_layer_input = table.rows
        model.self_decoder.vocab_size_per_layer_input = table.rows
        attach_worker(vllm_config, settings)
        if not isinstance(model, PleOffloadGemma4Model):
            raise PleModelError(f"expected PleOffloadGemma4Model, vLLM built "
                                f"{type(model).__name__}")
        model.set_parts(settings.geometry.slots_of(table.name),
                        settings.geometry.resident_layers)

    def load_weights(self, weights: Iterable[Weight]) -> set[str]:
        """vLLM's load, the PLE table skipped; with resident layers, their columns kept."""
        model = self.model
        if model.resident_table is None:
            return super().load_weights((n, w) for n, w in weights if PLE_WEIGHT not in n)

        def resident_taken(it: Iterable[Weight]) -> Iterator[Weight]:
            for name, w in it:
                if PLE_WEIGHT in name:
                    model.load_resident(w)
                else:
                    yield name, w

        loaded = super().load_weights(resident_taken(weights))
        if not model.resident_loaded:
            raise PleModelError("the checkpoint has no PLE table to take the resident layers' "
                                "columns from")
        return loaded
