"""Attention for packed rows: each piece attends causally to itself and fully to its context span,
never across pieces (see :mod:`rolemrc.data.packing` for the layout).

Three routes compute the same thing; :func:`packed_route` picks one per model:

- ``segments`` (sdpa/eager models that use transformers' AttentionInterface): a registered
  attention function runs one causal kernel per piece (``flash_attn_varlen_func`` in one call on a
  GPU with flash-attn, else ``scaled_dot_product_attention`` per piece). Cost grows with the sum of
  squared piece lengths, not the squared row length, and no ``[T, T]`` mask is ever built: the
  varlen computation, also on CPU. Calls without a layout go to the model's original attention,
  so generation and unpacked batches are unchanged.
- ``flash_varlen`` (flash_attention_* models, pieces without context): rows are flattened to one
  row and only ``position_ids`` are passed; transformers derives the varlen boundaries from the
  position resets (what ``DataCollatorWithFlattening`` relies on).
- ``mask`` (models whose attention cannot be swapped): a 4-D float additive mask ``[B, 1, T, T]``
  (0 = visible, dtype-min = hidden), which transformers passes through untouched. Float, not bool:
  a bool 4-D mask is silently wrong with ``eager``.

All three give the per-token log-probs of separate sequences to float tolerance
(tests/perf/test_packing.py).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rolemrc.config import PACKED_ATTENTION
from rolemrc.models.family import attention_implementation, base_model, input_embeddings, set_attention_implementation

log = logging.getLogger(__name__)

PREFIX = "rolemrc_packed_"  # registered attention name = PREFIX + the model's original one
# What was logged once per model (kept here, not as attributes on transformers' modules).
_KERNEL_LOGGED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_ROUTE_LOGGED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
LAYOUT_KWARG = "packed_layout"
ROUTES = tuple(r for r in PACKED_ATTENTION if r != "auto")  # segments, flash_varlen, mask


class SegmentLayout:
    """Pieces of a packed ``[B, T]`` batch: ``(row, start, end, ctx_start, ctx_end)`` each.

    Built once per forward from the collator's ``segments`` tensor and shared by every layer,
    which is why the index tensors below are cached on it.
    """

    def __init__(self, segments: Tensor | list[tuple[int, int, int, int, int]], batch: int, length: int) -> None:
        rows = segments.tolist() if isinstance(segments, Tensor) else list(segments)
        self.segments: list[tuple[int, int, int, int, int]] = [tuple(int(x) for x in s) for s in rows]
        self.batch, self.length = batch, length
        self._cache: dict[Any, Any] = {}

    def by_row(self) -> list[list[tuple[int, int, int, int]]]:
        """Pieces of each row in order: ``(start, end, ctx_start, ctx_end)``."""
        rows: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.batch)]
        for b, s, e, c0, c1 in sorted(self.segments):
            rows[b].append((s, e, c0, c1))
        return rows

    def additive_mask(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``[B, 1, T, T]`` float mask: 0 where a query may attend a key, ``finfo.min`` elsewhere.

        Padding queries see only themselves, so no softmax row is empty (no NaN anywhere).
        """
        allowed = torch.zeros(self.batch, self.length, self.length, dtype=torch.bool, device=device)
        idx = torch.arange(self.length, device=device)
        allowed[:, idx, idx] = True
        for b, s, e, c0, c1 in self.segments:
            allowed[b, s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool, device=device).tril()
            if c1 > c0:
                allowed[b, s:e, c0:c1] = True
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)

    def varlen_indices(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor, int, int]:
        """For ``flash_attn_varlen_func`` over ``[B*T]`` flattened tokens: query positions,
        key positions (context then own tokens per piece), ``cu_seqlens_q``/``_k`` (int32), and
        the longest query / key run."""
        key = ("varlen", str(device))
        if key not in self._cache:
            q_idx: list[int] = []
            k_idx: list[int] = []
            cu_q, cu_k = [0], [0]
            for b, s, e, c0, c1 in sorted(self.segments):
                off = b * self.length
                q_idx += range(off + s, off + e)
                k_idx += list(range(off + c0, off + c1)) + list(range(off + s, off + e))
                cu_q.append(len(q_idx))
                cu_k.append(len(k_idx))
            lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
            lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
            self._cache[key] = (torch.tensor(q_idx, dtype=torch.long, device=device),
                                torch.tensor(k_idx, dtype=torch.long, device=device),
                                torch.tensor(cu_q, dtype=torch.int32, device=device),
                                torch.tensor(cu_k, dtype=torch.int32, device=device),
                                max(lens_q, default=0), max(lens_k, default=0))
        return self._cache[key]

    def context_mask(self, n_ctx: int, n_q: int, device: torch.device) -> Tensor:
        """``[n_q, n_ctx + n_q]`` bool: the whole context, then causal over the piece itself."""
        key = ("ctx", n_ctx, n_q, str(device))
        if key not in self._cache:
            own = torch.ones(n_q, n_q, dtype=torch.bool, device=device).tril()
            ctx = torch.ones(n_q, n_ctx, dtype=torch.bool, device=device)
            self._cache[key] = torch.cat([ctx, own], dim=1)
        return self._cache[key]


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """``[B, Hkv, T, D] -> [B, Hkv * groups, T, D]`` (grouped-query attention)."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def _use_flash_attn(query: Tensor) -> bool:
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("flash_attn") is not None)


def attend_segments(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, layout: SegmentLayout,
                    dropout: float = 0.0, scaling: float | None = None) -> Tensor:
    """Attention over the pieces of ``layout``.

    query ``[B, Hq, T, D]``, key/value ``[B, Hkv, T, D]`` -> ``[B, T, Hq, D]`` (the layout
    transformers' attention functions return); padding positions get zeros.
    """
    b, hq, t, d = query.shape
    flash = _use_flash_attn(query)
    if getattr(module, "layer_idx", 0) == 0 and module not in _KERNEL_LOGGED:
        _KERNEL_LOGGED.add(module)
        log.info("packed attention kernel: %s", "flash_attn_varlen_func (all pieces in one call)" if flash
                 else "scaled_dot_product_attention per piece")
    if flash:
        from flash_attn import flash_attn_varlen_func

        q_idx, k_idx, cu_q, cu_k, max_q, max_k = layout.varlen_indices(query.device)
        q = query.transpose(1, 2).reshape(b * t, hq, d)
        k = key.transpose(1, 2).reshape(b * t, key.shape[1], d)
        v = value.transpose(1, 2).reshape(b * t, value.shape[1], d)
        # flash-attn aligns the causal mask bottom-right when a piece has more keys than queries:
        # exactly "whole context, then causal over itself".
        out = flash_attn_varlen_func(q[q_idx], k[k_idx], v[k_idx], cu_q, cu_k, max_q, max_k,
                                     dropout_p=dropout, softmax_scale=scaling, causal=True)
        full = out.new_zeros(b * t, hq, d).index_copy(0, q_idx, out)
        return full.view(b, t, hq, d)

    groups = hq // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    rows = []
    for row, pieces in enumerate(layout.by_row()):
        covered, sizes = 0, []
        for s, e, _, _ in pieces:
            if s != covered:
                raise ValueError(f"pieces of row {row} must be contiguous from 0; got one at {s}, expected {covered}")
            sizes.append(e - s)
            covered = e
        if covered < t:
            sizes.append(t - covered)  # the row's padding
        # One split per tensor, not a slice per piece: a split's backward is one concatenation,
        # where each slice's would fill a zero tensor of the whole row and add them up (per layer,
        # for q, k and v: with 2 threads such memory-bound ops cost more than the per-piece
        # kernels' FLOPs suggest, benchmarks/profile_sft.py). The segments route passes one
        # flattened row, taken whole.
        q_row, k_row, v_row = (x if b == 1 else x[row : row + 1] for x in (query, key, value))
        qs, ks, vs = (x.split(sizes, dim=2) for x in (q_row, k_row, v_row))
        parts = []
        for i, (s, e, c0, c1) in enumerate(pieces):
            if c1 > c0:
                k = torch.cat([k_row[:, :, c0:c1], ks[i]], dim=2)
                v = torch.cat([v_row[:, :, c0:c1], vs[i]], dim=2)
                mask = layout.context_mask(c1 - c0, e - s, query.device)
                o = F.scaled_dot_product_attention(qs[i], k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
            else:
                # No mask + is_causal: the fused (flash) kernel, which also skips the upper triangle.
                o = F.scaled_dot_product_attention(qs[i], ks[i], vs[i], dropout_p=dropout, is_causal=True, scale=scaling)
            parts.append(o)
        if covered < t:
            parts.append(query.new_zeros(1, hq, t - covered, d))
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous()


def _original_attention(module: nn.Module, name: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":  # every modeling file defines its own eager function
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise TypeError(f"{type(module).__name__}: no eager_attention_forward in {type(module).__module__}")
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


def _dispatcher(original: str) -> Callable:
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
        layout = kwargs.pop(LAYOUT_KWARG, None)
        if layout is None:
            return _original_attention(module, original)(module, query, key, value, attention_mask, dropout=dropout,
                                                         scaling=scaling, **kwargs)
        if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None or hasattr(module, "sinks"):
            raise NotImplementedError("packed attention supports plain causal attention only "
                                      "(no sliding window, logit softcapping or attention sinks)")
        return attend_segments(module, query, key, value, layout, dropout, scaling), None

    return attention


def install_segment_attention(model: nn.Module) -> bool:
    """Route ``model``'s attention through the packed-aware dispatcher; False if it cannot be.

    Only the in-memory config changes (the attention implementation is not saved with the model).
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    current = attention_implementation(model)
    if current.startswith(PREFIX):
        return True
    if current not in ("sdpa", "eager"):
        return False
    name = PREFIX + current
    AttentionInterface.register(name, _dispatcher(current))
    # Unpacked calls still need the original's masks (padding); packed calls pass a 4-D
    # placeholder, which transformers returns as-is, so no [T, T] mask is built for them.
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    return set_attention_implementation(model, name)


def packed_route(model: nn.Module, need_context: bool, prefer: str = "auto") -> str:
    """Which route computes packed attention for ``model`` (installing the dispatcher if needed),
    logged once per model.

    ``need_context``: some pieces see a context span (shared-prompt DPO), which the
    position-id-only flash path cannot express; a flash model is moved to sdpa for it.
    ``prefer`` (``model.packed_attention``): ``auto`` picks ``flash_varlen`` for flash-attention
    models without context spans, else ``segments`` where the attention can be swapped, else
    ``mask``; naming a route forces it, and one the model cannot take is refused.
    """
    if prefer not in PACKED_ATTENTION:
        raise ValueError(f"model.packed_attention must be auto or one of {', '.join(ROUTES)}, got {prefer!r}")
    base = base_model(model)
    impl = attention_implementation(base)
    flash = impl.startswith("flash_attention")
    if prefer == "flash_varlen" and (not flash or need_context):
        why = "shared-prompt pairs need context spans" if flash else f"the model's attention is {impl}"
        raise ValueError(f"model.packed_attention=flash_varlen needs model.attn_implementation=flash_attention_2 "
                         f"and no share_prompt ({why})")
    if prefer == "mask" and flash:
        raise ValueError(f"model.packed_attention=mask needs attn_implementation sdpa or eager, not {impl}")
    if impl.startswith(PREFIX):
        route = "mask" if prefer == "mask" else "segments"  # the dispatcher passes mask calls to the original
    elif flash and not need_context and prefer in ("auto", "flash_varlen"):
        route = "flash_varlen"
    else:
        if flash:
            log.warning("%s: %s cannot express %s; switching the model to sdpa with per-piece kernels",
                        "share_prompt" if need_context else "model.packed_attention=segments", impl,
                        "'rejected sees the prompt but not chosen'" if need_context else "per-piece kernels")
            set_attention_implementation(base, "sdpa")
            impl = attention_implementation(base)
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"packed rows / share_prompt need attn_implementation sdpa, eager or flash_attention_2, "
                             f"not {impl!r} (flex_attention has no CPU backward here)")
        if prefer == "mask":
            route = "mask"
        elif install_segment_attention(model):
            route = "segments"
        elif prefer == "segments":
            raise ValueError(f"model.packed_attention=segments: {type(base).__name__}'s attention cannot be swapped "
                             "(transformers' AttentionInterface); use auto or mask")
        else:
            route = "mask"
    _log_route(base, route, prefer)
    return route


_ROUTE_TEXT = {
    "segments": "one causal kernel per conversation (flash_attn_varlen_func on CUDA with flash-attn, "
                "else scaled_dot_product_attention per piece); cost grows with each conversation's length",
    "flash_varlen": "flash-attn varlen over one flattened row, boundaries from the position ids",
    "mask": "a [rows, 1, T, T] additive mask: exact, but attention costs grow with the packed row's length",
}


def _log_route(base: nn.Module, route: str, prefer: str) -> None:
    if _ROUTE_LOGGED.get(base) == route:
        return
    _ROUTE_LOGGED[base] = route
    log.info("packed attention (model.packed_attention=%s): %s: %s", prefer, route, _ROUTE_TEXT[route])


def flatten_rows(batch: dict[str, Tensor]) -> tuple[Tensor, list[tuple[int, int, int, int, int]]]:
    """Where the real tokens of a packed batch are (``keep`` [B, T] bool) and its pieces
    re-addressed into the one row ``[1, N]`` those tokens make. Rows hold their pieces contiguously from
    position 0, so row b's tokens start at the sum of the earlier rows' real lengths."""
    keep = batch["sequence_ids"] >= 0
    lengths = keep.sum(-1).tolist()
    offsets = [sum(lengths[:b]) for b in range(len(lengths))]
    segments = [(0, offsets[b] + s, offsets[b] + e, offsets[b] + c0, offsets[b] + c1)
                for b, s, e, c0, c1 in batch["segments"].tolist()]
    return keep, segments


def packed_hidden(decoder: nn.Module, batch: dict[str, Tensor], route: str) -> Tensor:
    """Last hidden states ``[B, T, H]`` of a packed batch (see :class:`PackedCollator`); zeros
    on padding for the flattening routes.

    ``segments`` and ``flash_varlen`` run the real tokens of all rows as one ``[1, N]`` row, so
    no padding is computed at all; ``mask`` keeps the ``[B, T]`` rows (its mask is ``T x T``).
    """
    ids, pos = batch["input_ids"], batch["position_ids"]
    b, t = ids.shape
    if route in ("segments", "flash_varlen"):
        keep, segments = flatten_rows(batch)
        flat_ids, flat_pos = ids[keep].unsqueeze(0), pos[keep].unsqueeze(0)
        if route == "segments":
            layout = SegmentLayout(segments, 1, flat_ids.shape[1])
            # A 4-D placeholder mask: transformers returns 4-D masks as they are, so it builds no
            # [N, N] mask that the per-piece kernels would not use anyway.
            placeholder = torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=ids.device)
            flat = decoder(input_ids=flat_ids, attention_mask=placeholder, position_ids=flat_pos,
                           **{LAYOUT_KWARG: layout}).last_hidden_state
        else:  # transformers finds the varlen boundaries where the position ids restart
            flat = decoder(input_ids=flat_ids, position_ids=flat_pos).last_hidden_state
        hidden = flat.new_zeros(b, t, flat.shape[-1])
        hidden[keep] = flat[0]
        return hidden
    if route == "mask":
        layout = SegmentLayout(batch["segments"], b, t)
        dtype = input_embeddings(decoder).weight.dtype
        dtype = dtype if dtype.is_floating_point else torch.float32
        return decoder(input_ids=ids, attention_mask=layout.additive_mask(dtype, ids.device),
                       position_ids=pos).last_hidden_state
    raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
