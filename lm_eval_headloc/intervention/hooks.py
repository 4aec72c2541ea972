"""Knockout hooks: ablate chosen attention heads and MLP neurons in any HF causal LM.

A head's output reaches the residual stream only through the attention output
projection (found by ``discovery``), whose input is the
concatenation of the heads' outputs. Zeroing the input slice
``[h*d_head:(h+1)*d_head]`` of that projection knocks out head ``h`` exactly: it is
what zeroing that head's columns of the projection's weight does. A neuron is the same
thing one feature wide on the MLP's output projection (``down_proj``, ``fc2`` …): input
feature ``n`` is neuron ``n``'s activation, and zeroing it is zeroing column ``n``.

The hooks are installed once and act only inside ``ComponentKnockout.applied``, on the
``Intervention`` (a value) given there; outside it the model is as loaded.

No lm-eval import here: this module works on a bare ``transformers``/PEFT model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lm_eval_headloc.intervention.ablation import AblationError, check_scale
from lm_eval_headloc.intervention.components import (
    Component,
    Neuron,
    describe_layers,
    names_neurons,
    parse_components,
)
from lm_eval_headloc.intervention.discovery import (
    find_attention_outputs,
    find_mlp_outputs,
    input_features,
    model_geometry,
)

__all__ = ["KINDS", "ActivePass", "ComponentKnockout", "Intervention", "kind_of"]


#: The kinds of component, in flat-index order (a design's columns: heads, then neurons).
KINDS: tuple[str, ...] = ("heads", "neurons")


def kind_of(component: Component) -> str:
    return "neurons" if isinstance(component, Neuron) else "heads"


@dataclass(frozen=True, eq=False)
class Intervention:
    """What one forward pass does to the model's components: a value, applied only inside
    ``ComponentKnockout.applied`` (nothing stays switched on after it).

    ``components`` (heads and MLP neurons) are knocked out in every batch row;
    ``row_masks`` ((rows, columns) booleans over the flat component index: head
    ``layer * H + head``, then, when wider than the heads, neuron
    ``L * H + layer * M + neuron``) knock out a different set in each row instead (several
    masks in one batch). A knocked-out slice becomes ``replacement + scale · (slice −
    replacement)``: the replacement is zero unless ``replacement`` gives, per kind
    (``"heads"``, ``"neurons"``), per-layer ``(units, width)`` means (``ablation.py``), or
    the pass is given resample donors; ``scale`` 0 is the replacement itself, 1 the
    component as it is (both exact), 2 amplification.
    """

    components: tuple[Component, ...] = ()
    row_masks: torch.Tensor | None = None
    scale: float = 0.0
    replacement: Mapping[str, tuple[torch.Tensor, ...]] | None = None

    def __post_init__(self) -> None:
        # A NaN scale would make every knocked-out slice NaN, silently.
        object.__setattr__(self, "scale", check_scale(self.scale))
        if self.row_masks is not None:
            object.__setattr__(self, "row_masks", _checked_row_masks(self.row_masks))

    @property
    def any_knocked_out(self) -> bool:
        """Whether a pass under it changes anything (scale 1 changes nothing)."""
        if self.scale == 1.0:
            return False
        if self.row_masks is not None:
            return bool(self.row_masks.any())
        return bool(self.components)

    @property
    def kinds(self) -> set[str]:
        """The kinds of component it knocks out."""
        if self.row_masks is not None:
            return set(KINDS)  # the width says; the knockout checks it
        return {kind_of(c) for c in self.components}

    def replace(self, **changes: Any) -> Intervention:
        return dataclasses.replace(self, **changes)


def _checked_row_masks(masks: Any) -> torch.Tensor:
    """Per-row masks as booleans. A knockout is all or nothing (a partial one is the
    ``scale``): a value other than 0 or 1 (False or True) is refused, where a bool cast
    counted 0.5 as knocked out."""
    masks = torch.as_tensor(masks)
    if masks.dtype == torch.bool:
        return masks
    stray = (masks != 0) & (masks != 1)  # NaN too
    if stray.any():
        at = tuple(torch.nonzero(stray)[0].tolist())
        raise AblationError(f"row_masks holds {masks[at].item()!r} at {at}: each entry is "
                            "True/False (or 1/0), knocked out or not; a partial knockout "
                            "is scale=, e.g. scale=0.5")
    return masks.bool()


@dataclass
class ActivePass:
    """The intervention of the forward pass(es) running now, placed per kind and layer."""

    masks: dict[str, list[torch.Tensor | None]]  # per layer: None or broadcastable bools
    rows: int | None  # per-row masks: the batch rows they are for
    scale: float
    replacement: dict[str, list[torch.Tensor | None]]
    # Resample: per kind and layer (donors, width, units, d) donor outputs, and per row
    # which donor position (donor × width + position) stands in for each column.
    donors: dict[str, list[torch.Tensor]] | None = None
    donor_index: torch.Tensor | None = None
    first_column: int = 0  # the columns a forward sees start here (generation's cache)


@dataclass
class _Site:
    """Where one kind of component is knocked out: a projection per layer whose input is
    ``units`` slices, each layer's ``widths[layer]`` wide (heads x head_dim, or neurons x
    1; Gemma 4's head width differs between its sliding and full attention layers). The
    lists have an entry per decoder layer, None in a layer without the kind (a hybrid
    model's layers without attention heads)."""

    modules: list[nn.Module | None]
    units: int
    widths: list[int | None]
    devices: list[torch.device | None]
    handles: list = dataclasses.field(default_factory=list)

    @property
    def layers(self) -> list[int]:
        """The layers that have the kind (every layer but a hybrid's others)."""
        return [layer for layer, module in enumerate(self.modules) if module is not None]

    def per_layer(self, present: Sequence[Any]) -> list[Any]:
        """``present`` (one entry per layer that has the kind, in order) spread over every
        layer, None in the others."""
        spread: list[Any] = [None] * len(self.modules)
        for layer, value in zip(self.layers, present, strict=True):
            spread[layer] = value
        return spread


class ComponentKnockout:
    """Ablation of attention heads, and MLP neurons, through forward pre-hooks on the
    attention (and MLP) output projections.

    >>> knockout = ComponentKnockout(model)                 # hooks installed once
    >>> with knockout.knocking_out("L0H3+L1N12"):      # for the passes inside only
    ...     model(input_ids)
    >>> model(input_ids)                               # the model as loaded

    The hooks are installed once and do nothing outside ``applied`` (or its shorthand
    ``knocking_out``), which scopes an ``Intervention`` to the passes run inside it, as
    TransformerLens's ``run_with_hooks`` scopes hooks to one call: switching costs a few
    small tensor writes, no re-registration. A layer with nothing knocked out returns at
    once. The MLP side is found the first time a neuron is asked for (or with
    ``neurons=True``/``mlp_out``), so a model whose MLP is not one projection per layer
    (a mixture of experts) still has its heads. ``hf-headablate`` (``model.py``) applies
    its components around each forward pass.
    """

    def __init__(self, model: nn.Module, attn_out: str | None = None,
                 mlp_out: str | None = None, neurons: bool = False) -> None:
        self.model = model
        self.geometry = model_geometry(model)
        self.num_layers = self.geometry.num_layers
        self.heads_per_layer = self.geometry.heads_per_layer
        #: The layers with heads (every layer but a hybrid model's others).
        self.layers_with_heads = self.geometry.layers_with_heads
        modules = find_attention_outputs(model, attn_out)
        #: The first layer's head width (``geometry.Geometry.head_dim_of`` gives each layer's).
        self.head_dim = input_features(modules[0]) // self.heads_per_layer
        self.attn_out, self.mlp_out = attn_out, mlp_out
        self._shared = False  # whether ``on`` may hand it to another caller
        self._sites: dict[str, _Site] = {}
        self._active: ActivePass | None = None
        self._placed: tuple[Intervention, ActivePass] | None = None  # the last one placed
        self._removed = False
        self._add_site("heads", dict(zip(self.layers_with_heads, modules, strict=True)),
                       self.heads_per_layer)
        if neurons or mlp_out:
            try:
                self.enable_neurons()
            except BaseException:  # a bad mlp_out= leaves the caller's model unhooked
                self.remove()
                raise

    @classmethod
    def on(cls, model: nn.Module, attn_out: str | None = None, mlp_out: str | None = None
           ) -> tuple[ComponentKnockout, bool]:
        """A knockout for ``model`` that shares its hooks: the one an earlier ``on`` hooked
        it with (the same ``attn_out``/``mlp_out``, not removed), else a new one. Returns
        it and whether it is new. Its hooks only act inside ``applied``, so each caller's
        passes stay its own; a new set per caller made every pass of a model wrapped again
        and again (a notebook's loop) run one more idle hook per layer each time."""
        for module in model.modules():
            for hook in module._forward_pre_hooks.values():
                knockout = getattr(hook, "knockout", None)
                if (isinstance(knockout, cls) and knockout._shared and knockout.model is model
                        and not knockout._removed
                        and (knockout.attn_out, knockout.mlp_out) == (attn_out, mlp_out)):
                    return knockout, False
        knockout = cls(model, attn_out=attn_out, mlp_out=mlp_out)
        knockout._shared = True
        return knockout, True

    def _add_site(self, kind: str, modules: Mapping[int, nn.Module], units: int) -> None:
        every = [modules.get(layer) for layer in range(self.num_layers)]
        site = _Site(every, units,
                     [None if m is None else input_features(m) // units for m in every],
                     [None if m is None else _device_of(m) for m in every])
        site.handles = [module.register_forward_pre_hook(self._make_hook(kind, layer))
                        for layer, module in modules.items()]
        self._sites[kind] = site

    def enable_neurons(self) -> None:
        """Find the MLP output projections and hook them (once; raises
        ``MLPOutputNotFound`` naming ``mlp_out=`` when they cannot be told)."""
        if "neurons" in self._sites:
            return
        modules = find_mlp_outputs(self.model, self.mlp_out)
        self._add_site("neurons", dict(enumerate(modules)), input_features(modules[0]))
        self._placed = None

    @property
    def modules(self) -> list[nn.Module]:
        """The attention output projections, one per layer with heads."""
        return self.site_modules(["heads"])

    @property
    def has_neurons(self) -> bool:
        return "neurons" in self._sites

    @property
    def mlp_modules(self) -> list[nn.Module]:
        """The MLP output projections, one per layer (found on first use)."""
        return self.site_modules(["neurons"])

    @property
    def neurons_per_layer(self) -> int:
        self.enable_neurons()
        return self._sites["neurons"].units

    def site_modules(self, kinds: Iterable[str]) -> list[nn.Module]:
        """The hooked modules of ``kinds`` (in ``KINDS`` order, each kind's layers in
        order; only the layers that have the kind): what mean and resample ablation
        record."""
        return [m for kind in KINDS if kind in set(kinds) for m in self._site(kind).modules
                if m is not None]

    def site_layers(self, kind: str) -> list[int]:
        """The layer of each of ``site_modules([kind])``."""
        return self._site(kind).layers

    def _site(self, kind: str) -> _Site:
        if kind == "neurons":
            self.enable_neurons()
        return self._sites[kind]

    def _make_hook(self, kind: str, layer: int):
        def knock_out(module: nn.Module, args: tuple):
            active = self._active
            masks = None if active is None else active.masks.get(kind)
            mask = None if masks is None else masks[layer]
            if mask is None:
                return None
            hidden, flat = self.with_rows(args[0])
            rest = args[1:]
            if active.rows is not None and active.rows != hidden.shape[0]:
                raise RuntimeError(f"per-row masks for {active.rows} rows, batch has "
                                   f"{hidden.shape[0]}")
            if mask.device != hidden.device:  # a model split across devices
                mask = masks[layer] = mask.to(hidden.device)
            # (..., units*width) -> (..., units, width)
            units = self._sites[kind].units
            per_unit = self._ablated(kind, layer, hidden.unflatten(-1, (units, -1)), mask)
            out = per_unit.flatten(-2)
            return (out.flatten(0, 1) if flat else out, *rest)

        knock_out.knockout = self  # what ``on`` finds on a hooked model
        return knock_out

    def _ablated(self, kind: str, layer: int, per_unit: torch.Tensor, mask: torch.Tensor
                 ) -> torch.Tensor:
        """``per_unit`` (..., units, width) with the units in ``mask`` (broadcastable,
        True = out) replaced: the one place the ablation kind and the scale act."""
        scale = self._active.scale
        if scale == 1.0:
            return per_unit  # the component as it is, exactly
        replacement = self.replacement(layer, per_unit, kind)
        if replacement is None:
            if scale == 0.0:
                return per_unit.masked_fill(mask, 0)  # exact zeros whatever the dtype
            return torch.where(mask, per_unit * scale, per_unit)
        if scale == 0.0:
            return torch.where(mask, replacement, per_unit)
        return torch.where(mask, replacement + scale * (per_unit - replacement), per_unit)

    def with_rows(self, hidden: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A hooked projection's input in the pass running now as (rows, positions,
        features), and whether it came flattened: OPT's MLP sees its batch as (rows ×
        positions, features), and per-row masks and resample's donors need the rows back
        (the pass knows them where it has either)."""
        if hidden.dim() != 2:  # every model but OPT's MLP: nothing else to read per call
            return hidden, False
        active = self._active
        rows = None if active is None else active.rows if active.donor_index is None \
            else active.donor_index.shape[0]
        if rows is None or hidden.shape[0] % rows:
            return hidden, False
        return hidden.unflatten(0, (rows, -1)), True

    @property
    def active(self) -> ActivePass | None:
        """The intervention of the passes running now (None outside ``applied``, or inside
        ``applied(None)``: the model as loaded)."""
        return self._active

    def replacement(self, layer: int, per_unit: torch.Tensor, kind: str = "heads"
                    ) -> torch.Tensor | None:
        """What layer ``layer``'s knocked-out components of ``kind`` become where their
        projection sees ``per_unit`` (..., units, width) in the active pass: None for
        zeros, else a tensor broadcastable to it (the mean's (units, width), or the donors'
        (rows, columns, units, width) under resample)."""
        active = self._active
        if active is None:
            return None
        if active.donors is not None:
            donors, index = active.donors[kind][layer], active.donor_index
            if per_unit.dim() != 4 or per_unit.shape[0] != index.shape[0]:
                raise RuntimeError(f"resample ablation: layer {layer} sees "
                                   f"{tuple(per_unit.shape[:-2])} positions, donors were set "
                                   f"for {index.shape[0]} rows")
            columns = per_unit.shape[1]
            picked = index[:, active.first_column:active.first_column + columns]
            if picked.shape[1] != columns:
                raise RuntimeError(f"resample ablation: columns {active.first_column}.."
                                   f"{active.first_column + columns} past the "
                                   f"{index.shape[1]} donors were aligned to")
            # (donors × width, units, d) indexed by (rows, columns): each row's donor.
            return donors.flatten(0, 1)[picked.to(donors.device)].to(per_unit)
        replacements = active.replacement.get(kind)
        replacement = None if replacements is None else replacements[layer]
        if replacement is None:
            return None
        if replacement.device != per_unit.device or replacement.dtype != per_unit.dtype:
            replacement = replacements[layer] = replacement.to(per_unit)
        return replacement

    def check_replacement(self, per_layer: Sequence[torch.Tensor | None], kind: str = "heads"
                          ) -> tuple[torch.Tensor | None, ...]:
        """Per-layer ``(units, width)`` means of ``kind`` (one per layer that has the kind,
        as ``site_modules`` lists them, or one per layer with None where it has none),
        checked and placed on each layer's device, for ``Intervention.replacement``;
        returned one per layer."""
        site = self._site(kind)
        layers = site.layers
        if len(per_layer) == len(layers) and len(layers) != self.num_layers:
            per_layer = site.per_layer(per_layer)
        shapes = [(site.units, site.widths[layer]) for layer in layers]
        if len(per_layer) != self.num_layers or any(
                per_layer[layer] is None or tuple(per_layer[layer].shape) != shape
                for layer, shape in zip(layers, shapes, strict=True)):
            described = (f"shape {shapes[0]}" if len(set(shapes)) == 1
                         else f"shapes {shapes}")
            raise ValueError(f"{kind} replacements must be {len(layers)} tensors of "
                             f"{described}")
        return tuple(None if device is None else t.to(device)
                     for t, device in zip(per_layer, site.devices, strict=True))

    def flat_width(self, kinds: Iterable[str]) -> int:
        """Columns of a row mask over ``kinds``: all heads, then (with neurons) all
        neurons (a hybrid model's layers without heads keep their columns, which must
        stay False)."""
        return sum(self.num_layers * self._site(kind).units for kind in KINDS
                   if kind in set(kinds))

    def row_masks(self, masks: Sequence[Iterable[Component]]) -> torch.Tensor:
        """(len(masks), columns) booleans knocking out each mask's components in its row,
        for ``Intervention.row_masks``: as wide as the heads, or, when a mask has a
        neuron, as the heads and every neuron."""
        masks = [list(mask) for mask in masks]
        kinds = {kind_of(c) for mask in masks for c in mask} | {"heads"}
        rows = torch.zeros(len(masks), self.flat_width(kinds), dtype=torch.bool)
        heads = self.flat_width(["heads"])
        for row, mask in enumerate(masks):
            for component in mask:
                if isinstance(component, Neuron):
                    rows[row, heads + component.layer * self.neurons_per_layer
                         + component.neuron] = True
                else:
                    rows[row, component.layer * self.heads_per_layer + component[1]] = True
        return rows

    def kinds_of(self, intervention: Intervention) -> list[str]:
        """The kinds ``intervention`` knocks out (heads when none): what its resample
        donors must be recorded for (``applied``'s ``donors``), in ``KINDS`` order."""
        # What _place would key its masks by, without placing anything (this runs before
        # every measurement and, under resample, every forward pass).
        if intervention.row_masks is not None:
            width = int(intervention.row_masks.shape[-1])
            kinds = ["heads"] if width == self.flat_width(["heads"]) else list(KINDS)
        else:
            kinds = [kind for kind in KINDS if kind in intervention.kinds]
        return kinds or ["heads"]

    def _place(self, intervention: Intervention) -> ActivePass:
        """Per-kind, per-layer device masks for ``intervention`` (the last one is kept: a
        model answering many requests under one intervention places it once)."""
        if self._placed is not None and self._placed[0] is intervention:
            placed = self._placed[1]
            return dataclasses.replace(
                placed, masks={k: list(v) for k, v in placed.masks.items()},
                replacement={k: list(v) for k, v in placed.replacement.items()})
        layers = self.num_layers
        masks: dict[str, list[torch.Tensor | None]] = {}
        rows = None
        if intervention.row_masks is not None:
            knocked = torch.as_tensor(intervention.row_masks, dtype=torch.bool)
            heads_only = self.flat_width(["heads"])
            if knocked.ndim == 2 and knocked.shape[1] > heads_only:
                self.enable_neurons()
            kinds = ["heads"] if knocked.ndim == 2 and knocked.shape[1] == heads_only \
                else list(KINDS)
            width = self.flat_width(kinds)
            if knocked.ndim != 2 or knocked.shape[1] != width:
                raise ValueError(f"per-row masks must have shape (rows, {heads_only}) for "
                                 f"heads or (rows, {self.flat_width(KINDS)}) for heads and "
                                 f"neurons, got {tuple(knocked.shape)}")
            rows, start = knocked.shape[0], 0
            on_device: dict[Any, torch.Tensor] = {}  # the whole mask, once per device
            for kind in kinds:
                site = self._sites[kind]
                span = slice(start, start + layers * site.units)
                by_layer = knocked[:, span].view(-1, layers, site.units)
                start += layers * site.units
                stray = [layer for layer, module in enumerate(site.modules)
                         if module is None and by_layer[:, layer].any()]
                if stray:
                    raise ValueError(f"per-row masks knock out {kind} in layer {stray[0]}, "
                                     f"which has none (the layers with {kind}: "
                                     f"{describe_layers(site.layers)})")
                touched = by_layer.any(dim=(0, 2)).tolist()
                masks[kind] = []
                for layer in range(layers):
                    device = site.devices[layer]
                    if not touched[layer]:
                        masks[kind].append(None)
                        continue
                    if device not in on_device:
                        on_device[device] = _to_device_without_waiting(knocked, device)
                    masks[kind].append(on_device[device][:, span].view(
                        -1, layers, site.units)[:, layer][:, None, :, None])
        else:
            by_layer: dict[tuple[str, int], list[int]] = {}
            kinds = intervention.kinds
            if "neurons" in kinds:
                self.enable_neurons()
            checked = parse_components(
                intervention.components, layers, self.heads_per_layer,
                self._sites["neurons"].units if "neurons" in kinds else None,
                head_layers=self.geometry.head_layers)
            for component in checked:
                by_layer.setdefault((kind_of(component), component.layer),
                                    []).append(component[1])
            for (kind, layer), indices in by_layer.items():
                site = self._sites[kind]
                mask = torch.zeros(site.units, 1, dtype=torch.bool)
                mask[indices] = True
                masks.setdefault(kind, [None] * layers)[layer] = mask.to(site.devices[layer])
            masks = {kind: masks[kind] for kind in KINDS if kind in masks}
        # Every kind given, knocked out or not: attribution (measurement/attribution.py) reads the
        # replacement of a pass that knocks out nothing.
        replacement = {kind: list(self.check_replacement(per_layer, kind))
                       for kind, per_layer in (intervention.replacement or {}).items()}
        placed = ActivePass(masks, rows, float(intervention.scale), replacement)
        self._placed = (intervention, placed)
        return dataclasses.replace(placed, masks={k: list(v) for k, v in masks.items()},
                                   replacement={k: list(v) for k, v in replacement.items()})

    @contextlib.contextmanager
    def applied(self, intervention: Intervention | None,
                donors: tuple[list[torch.Tensor], torch.Tensor] | None = None
                ) -> Iterator[ActivePass | None]:
        """Inside, every forward pass of the model runs under ``intervention`` (None: the
        model as loaded, e.g. resample's own clean pass for its donors); the previous
        state (usually none) is back on exit, whatever happens inside. ``donors``:
        resample ablation's ``(per_module, index)``: ``per_module`` holds, for the modules
        of ``site_modules(kinds)`` in that order (the kinds the intervention knocks out),
        the donors' inputs (donors, width, features); ``index`` (rows, columns) which
        donor position replaces each column of that row, as donor × width + position
        (``ablation.Resampler.donors``: rows that share a donor share its outputs). Yields
        the ``ActivePass``."""
        if self._removed:  # its hooks are off the model: a knockout would change nothing
            raise RuntimeError("this ComponentKnockout's hooks were taken off the model "
                               "(remove()); make a new ComponentKnockout(model)")
        active = None if intervention is None else self._place(intervention)
        if active is not None and donors is not None:
            per_module, index = donors
            kinds = list(active.masks) or ["heads"]
            counts = [len(self._sites[kind].layers) for kind in kinds]
            if len(per_module) != sum(counts) or index is None or index.dim() != 2:
                wanted = ", ".join(f"{n} of {k}" for k, n in zip(kinds, counts, strict=True))
                raise ValueError(f"donors must be a tensor per hooked module ({wanted}) and "
                                 "a (rows, columns) index")
            active.donors = {}
            start = 0
            for kind, count in zip(kinds, counts, strict=True):
                site = self._sites[kind]
                chunk = site.per_layer(per_module[start:start + count])
                start += count
                active.donors[kind] = [None if t is None else
                                       t.unflatten(-1, (site.units, -1)).to(device)
                                       for t, device in zip(chunk, site.devices, strict=True)]
            # On the donors' device once, not in every layer of every pass.
            first = next((t.device for ts in active.donors.values() for t in ts
                          if t is not None), None)
            active.donor_index = index if first is None else index.to(first)
        saved, self._active = self._active, active
        try:
            yield active
        finally:
            self._active = saved

    def knocking_out(self, components: str | Iterable[str | Component | tuple[int, int]], *,
                     scale: float = 0.0) -> contextlib.AbstractContextManager:
        """``applied`` for ``components`` (a ``L0H1+L2N3`` string or a list) zeroed, or
        scaled by ``scale``: the shorthand for a bare model."""
        if isinstance(components, str) and not components.strip():
            parsed: tuple[Component, ...] = ()
        else:  # checked against the model, which also expands L0H* and L0N*
            neurons = (self.neurons_per_layer if self.has_neurons
                       or names_neurons(components) else None)
            parsed = tuple(parse_components(components, self.num_layers,
                                            self.heads_per_layer, neurons,
                                            head_layers=self.geometry.head_layers))
        return self.applied(Intervention(components=parsed, scale=scale))

    def remove(self) -> None:
        """Take the hooks off the model (the model is then as loaded)."""
        for site in self._sites.values():
            for handle in site.handles:
                handle.remove()
            site.handles = []
        self._removed = True

    def __repr__(self) -> str:
        neurons = (f", {self._sites['neurons'].units} MLP neurons"
                   if "neurons" in self._sites else "")
        some = ("" if self.geometry.head_layers is None else
                f", heads in layers {describe_layers(self.layers_with_heads)}")
        return (f"ComponentKnockout({self.num_layers} layers x {self.heads_per_layer} heads"
                f"{some}{neurons})")


def _to_device_without_waiting(tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """``tensor.to(device)`` that does not make the host wait for the GPU's queued work.

    Per-row masks are placed for every forward pass: a plain copy from pageable host
    memory waits for the previous pass to finish before the host may queue the next one
    (the GPU idle in between). From pinned memory the copy is queued like a kernel, and
    PyTorch keeps the pinned source alive until it is done."""
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")
