"""How much one forward pass takes: rows per pass and masks per pass.

``batch_size=auto`` uses lm-eval's own detection on the widest request actually sent;
the masks per pass on a GPU are sized from the free memory and the batches actually sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lm_eval_headloc.intervention.geometry import Geometry, text_config

__all__ = ["CPU_GENERATION_ROWS", "MOST_MASKS_PER_PASS", "auto_batch_size", "batch_size",
           "generation_batch_size",
           "generation_masks_for_memory", "generation_masks_per_pass", "is_out_of_memory",
           "masks_per_pass", "masks_per_pass_for_memory"]

#: The most masks per pass the automatic K gives.
MOST_MASKS_PER_PASS = 64
#: The share of free GPU memory the automatic K fills with generating rows: their key/value
#: cache is counted exactly, so less is held back than for loglikelihood passes (half).
GENERATION_MEMORY_SHARE = 0.85
#: The rows a ``generate`` call on a CPU is filled to with masks (K = this over the rows per
#: mask). A decoding step's cost grows far less than its rows up to about a hundred rows:
#: on the embedded SmolLM2 (BENCH.md, 2 cores), 128 rows per call took 1.4-2.1x less time
#: per mask than K = 1 on rhyme (32 rows per mask), swear (16) and rhyme_heldout (32); 256
#: rows took 6-14 % less than 128 on rhyme and rhyme_heldout and 16 % more on swear.
CPU_GENERATION_ROWS = 128
#: The share of the available CPU memory the automatic K's generating rows may fill.
CPU_MEMORY_SHARE = 0.5
#: How CUDA errors that are not ``torch.OutOfMemoryError`` say they ran out of memory.
OUT_OF_MEMORY_WORDS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says the GPU ran out of memory (``torch.OutOfMemoryError``, or the
    plain ``RuntimeError`` cuBLAS and some kernels raise): what a smaller pass may fix."""
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(w in str(error) for w in OUT_OF_MEMORY_WORDS))


def batch_size(lm: Any, requests: Callable[[], Any]) -> int:
    """Rows per forward pass (per mask) of the scored-positions path: the model's
    ``batch_size``, or for ``auto``/``auto:N`` what lm-eval's own detection finds for the
    widest of ``requests()`` (``auto_batch_size``)."""
    size = lm.batch_size
    if isinstance(size, int):
        return size
    return auto_batch_size(lm, requests())  # HFLM keeps "auto" for both auto and auto:N


def masks_per_pass(lm: Any, requests: Callable[[], Any], rows: Callable[[], int],
                   scored_positions: bool) -> int:
    """Masks per forward pass when none is asked for. 1 on a CPU, where the forward is
    compute-bound and batching masks gains little (BENCH.md), and whenever masks are
    measured one at a time anyway (generation tasks, ``scored_positions`` False). On a
    GPU: as many as half of the free memory (the driver's, plus what PyTorch's allocator
    holds unused) holds for the widest batch actually sent (``masks_per_pass_for_memory``);
    ``rows()`` is the resolved batch size."""
    import torch

    device = torch.device(lm.device)
    if device.type != "cuda" or not scored_positions:
        return 1
    # The batch size first: its auto detection uses memory, then frees it.
    shapes = requests().shapes(rows())
    free, _ = torch.cuda.mem_get_info(device)
    # Blocks PyTorch's allocator holds but nothing uses (after the prior's backward pass,
    # a freed model) count as taken for the driver, yet are this process's to reuse.
    free += max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    model = lm.model
    return masks_per_pass_for_memory(free, shapes, model.config,
                                     torch.finfo(model.dtype).bits // 8)


def auto_batch_size(lm: Any, requests: Any) -> int:
    """Rows per forward pass for ``batch_size=auto``: lm-eval's own detection (HFLM
    ``_detect_batch_size``: from ``max_batch_size`` down, halving on out-of-memory),
    probed with the widest of ``requests`` (``multimask.LoglikelihoodRequests``) rather
    than ``max_length`` tokens, so on a CPU the probe costs a few short forwards. No
    requests: 1 (nothing to batch).
    """
    if not requests.keys:
        return 1
    context, continuation = requests.widest()
    return int(lm._detect_batch_size([(None, context, continuation)], 0))


def _generation_shape(lm: Any, instances: Sequence[Any]) -> tuple[list[int], int] | None:
    """The widest prompt's tokens (as HFLM cuts it) and the most tokens any of the
    generation requests ``instances`` may generate; None without generation requests."""
    generating = [i for i in instances if i.request_type == "generate_until"]
    if not generating:
        return None
    default = int(getattr(lm, "max_gen_toks", 256))
    longest = max(int((i.args[1] if len(i.args) > 1 and isinstance(i.args[1], dict) else {})
                      .get("max_gen_toks", default)) for i in generating)
    widest = max((lm.tok_encode(i.args[0]) for i in generating), key=len)
    # HFLM cuts a prompt on the left to leave room for the generated tokens.
    return widest[-max(1, int(lm.max_length) - longest):], longest


def generation_batch_size(lm: Any, instances: Sequence[Any]) -> int | None:
    """Rows per ``generate`` call for ``batch_size=auto``, from the generation requests
    ``instances`` actually sent: lm-eval's own detection (halving on out-of-memory) probed
    with the widest prompt plus the most tokens any request may generate, from every
    request in one batch down (a generating step costs about as much for 100 rows as for
    32 on a GPU: BENCH.md). HFLM's ``generate_until`` would instead probe rows of the
    model's whole ``max_length`` (8,192 tokens for SmolLM2, 131,072 for Llama-3.1) on
    every call: minutes on a CPU, out of memory at one row on a GPU. None without
    generation requests."""
    shape = _generation_shape(lm, instances)
    if shape is None:
        return None
    prompt, longest = shape
    rows = sum(i.request_type == "generate_until" for i in instances)
    saved = lm.max_batch_size
    lm.max_batch_size = rows  # lm-eval's probe starts here
    try:
        return int(lm._detect_batch_size([(None, prompt, [0] * (longest + 1))], 0))
    finally:
        lm.max_batch_size = saved


def generation_masks_per_pass(lm: Any, instances: Sequence[Any], rows: int) -> int:
    """Masks per ``generate`` call when none is asked for. On a GPU, as many as
    ``GENERATION_MEMORY_SHARE`` of the free memory holds with ``rows`` rows per mask, each
    generating the most tokens any request may from the widest prompt
    (``generation_masks_for_memory``); on a CPU, enough to fill a call to
    ``CPU_GENERATION_ROWS`` rows, at most what ``CPU_MEMORY_SHARE`` of the available
    memory holds."""
    import torch

    device = torch.device(lm.device)
    shape = _generation_shape(lm, instances)
    if shape is None:
        return 1
    prompt, longest = shape
    model = lm.model
    if device.type != "cuda":
        import psutil

        fits = generation_masks_for_memory(
            int(psutil.virtual_memory().available * CPU_MEMORY_SHARE
                / GENERATION_MEMORY_SHARE), rows, len(prompt), longest, model.config,
            torch.finfo(model.dtype).bits // 8)
        # A call's rows per mask: the batch, or every request where there are fewer.
        per_mask = max(1, min(rows, sum(i.request_type == "generate_until"
                                        for i in instances)))
        return max(1, min(fits, CPU_GENERATION_ROWS // per_mask))
    free, _ = torch.cuda.mem_get_info(device)
    free += max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return generation_masks_for_memory(free, rows, len(prompt), longest, model.config,
                                       torch.finfo(model.dtype).bits // 8)


@dataclass(frozen=True)
class _Widths:
    """What the memory of a pass scales with, read off a model's config."""

    hidden: int
    heads: int
    head_dim: int
    kv_heads: int
    ffn: int
    attention_layers: int
    other_layers: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> _Widths:
        text = text_config(config)
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        geometry = Geometry.from_config(text)
        attention_layers = len(geometry.layers_with_heads)
        return cls(
            hidden=hidden, heads=heads,
            # The widest layer's heads (Gemma 4's full-attention layers are wider).
            head_dim=(max(geometry.layer_head_dims) if geometry.layer_head_dims
                      else geometry.head_dim or hidden // heads),
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            ffn=int(geometry.neurons_per_layer or 4 * hidden),
            attention_layers=attention_layers,
            other_layers=geometry.num_layers - attention_layers,
            vocab=int(text.vocab_size))

    def kv_cache(self, tokens: int, bytes_per_value: int) -> int:
        """The key/value cache every attention layer keeps for ``tokens`` tokens."""
        return (tokens * self.attention_layers * 2 * self.kv_heads * self.head_dim
                * bytes_per_value)

    def forward(self, rows: int, width: int, bytes_per_value: int) -> int:
        """One layer's activations (residual, q/k/v/output, MLP), eager attention weights
        for one layer, and the recurrent state a hybrid model's other layers keep per row
        (counted at 2 x hidden x 128 values: Gated DeltaNet's and Mamba-2's, generously)."""
        tokens = rows * width
        activations = tokens * (6 * self.hidden + 3 * self.ffn) * bytes_per_value
        attention = rows * self.heads * width * width * bytes_per_value
        states = rows * self.other_layers * 2 * self.hidden * 128 * bytes_per_value
        return activations + attention + states


def generation_masks_for_memory(free_bytes: int, rows: int, prompt_width: int,
                                new_tokens: int, config: Any, bytes_per_value: int = 2,
                                most: int = MOST_MASKS_PER_PASS) -> int:
    """How many masks of ``rows`` rows each fit in ``GENERATION_MEMORY_SHARE`` of
    ``free_bytes`` when they generate together, ``new_tokens`` after prompts
    ``prompt_width`` wide.

    Per copy, the larger of the two peaks: the prompts' forward pass (their key/value
    cache, one layer's activations and eager attention weights, the last position's
    logits in float32 as ``generate`` keeps them) and the last step's key/value cache of
    prompt + ``new_tokens`` (a decoding step's own activations are one token per row).
    """
    widths = _Widths.of(config)
    logits = rows * widths.vocab * (bytes_per_value + 8)
    prefill = (widths.kv_cache(rows * prompt_width, bytes_per_value)
               + widths.forward(rows, prompt_width, bytes_per_value) + logits)
    last_step = (widths.kv_cache(rows * (prompt_width + new_tokens), bytes_per_value)
                 + widths.forward(rows, 1, bytes_per_value) + logits)
    need = max(prefill, last_step)
    if need == 0:
        return most
    return int(max(1, min(most, GENERATION_MEMORY_SHARE * free_bytes // need)))


def masks_per_pass_for_memory(free_bytes: int, shapes: Sequence[tuple[int, int, int]],
                              config: Any, bytes_per_value: int = 2,
                              most: int = MOST_MASKS_PER_PASS) -> int:
    """How many masks fit in half of ``free_bytes`` when each forward pass holds K copies
    of a batch, for the largest of the batches ``shapes`` ((rows, width, scored tokens),
    ``LoglikelihoodRequests.shapes``: the batches actually sent, not ``max_length`` rows).

    Per copy: one layer's activations (residual, q/k/v/output, MLP), the key/value cache
    the forward keeps for every attention layer (a hybrid model's other layers keep a
    recurrent state per row instead, counted at 2 x hidden x 128 values: Gated DeltaNet's
    and Mamba-2's, generously), eager attention weights for one layer, and the
    logits at the scored tokens with their log-softmax (counted at up to 8 bytes, for a
    float64 ``softmax_dtype``). Deliberately generous: a wrong guess costs an
    out-of-memory error, a low one only some speed.
    """
    widths = _Widths.of(config)

    def per_copy(rows: int, width: int, scored: int) -> int:
        logits = scored * widths.vocab * (bytes_per_value + 8)
        return (widths.kv_cache(rows * width, bytes_per_value)
                + widths.forward(rows, width, bytes_per_value) + logits)

    need = max((per_copy(*shape) for shape in shapes), default=0)
    if need == 0:
        return most  # nothing to compute: any K fits
    return int(max(1, min(most, free_bytes // 2 // need)))
