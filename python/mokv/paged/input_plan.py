"""Planning one replica's runtime-input tables: a batch checked in one pass.

One pass over a replica's resolved batch checks every request (pages for
this step) while it collects each request's cache length and the batch's
maxima; the `TablePlan` it returns is everything `InputStaging.build` needs,
and nothing is written until every replica's batch has passed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validation import check_int
from .page_table import TableRows
from .request_state import BatchEntry

_UINT32_MAX = (1 << 32) - 1


@dataclass(frozen=True)
class BatchCharacteristics:
    """An upper bound on a batch's shape, for replaying a graph captured at that shape.

    When given to `runtime_inputs`, `max_lengths` row 0 reports these values
    instead of the batch's own (which must not exceed them).
    """

    batch_size: int
    max_prompt_length: int
    max_cache_valid_length: int

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_prompt_length", "max_cache_valid_length"):
            check_int(name, getattr(self, name), minimum=0, maximum=_UINT32_MAX)


@dataclass(eq=False, slots=True)
class TablePlan:
    """One replica's tables for a batch, as `InputStaging.build` writes them
    (made once per replica and call: not frozen, which would cost more than
    building it)."""

    rows: TableRows
    """The batch entries' rows of the replica's page table, in batch order."""
    cache_lengths: list[int]
    """Per batch entry, its `processed_length`."""
    needed: list[int] | None
    """Per batch entry, the pages this step reads, when some entry holds more
    (the rest of its row is masked to the null page); None when every entry
    holds exactly what it needs."""
    width: int
    """The lookup table's width in pages."""
    max_new: int
    """`max_lengths` row 0: the most new tokens of a request at the first step."""
    max_context: int
    """`max_lengths` row 0: the longest context at the first step, new tokens included."""
    num_steps: int
    """Rows of `max_lengths` (later steps run one token each)."""


def plan_tables(
    entries: list[BatchEntry],
    rows: TableRows,
    page_size: int,
    num_steps: int,
    max_cache_length: int | None,
    batch_characteristics: BatchCharacteristics | None,
) -> TablePlan:
    """Checks a replica's resolved batch (`entries`, at page-table `rows`:
    each request holds the pages this step needs) and plans its tables.

    Raises:
        ValueError: A request without pages for the step, a `max_cache_length`
            narrower than the batch, or a batch exceeding
            `batch_characteristics`, each named.
    """
    ps = page_size
    extra = num_steps - 1  # tokens written by the steps after the first
    round_up = extra + ps - 1
    lengths: list[int] = []
    held_more = False
    max_new = max_context = 0
    for ctx, state in entries:
        processed = ctx.processed_length
        current = ctx.current_length
        need = (current + round_up) // ps
        held = state.num_pages
        if held != need and not state.is_dummy:  # a dummy's row is null pages whatever its length
            if held < need:
                raise ValueError(
                    f"request {ctx.request_id!r} holds {held} pages but needs {need} for "
                    f"{current + extra} tokens: call alloc first"
                )
            held_more = True
        lengths.append(processed)
        if current > max_context:
            max_context = current
        if current - processed > max_new:
            max_new = current - processed
    width = (max_context + round_up) // ps if lengths else 0
    if max_cache_length is not None:
        fixed = -(-max_cache_length // ps)
        if fixed < width:
            raise ValueError(f"max_cache_length={max_cache_length} gives {fixed} pages, but the batch needs {width}")
        width = fixed
    if batch_characteristics is not None:
        bc = batch_characteristics
        batch_size = len(lengths)
        if batch_size > bc.batch_size or max_new > bc.max_prompt_length or max_context > bc.max_cache_valid_length:
            raise ValueError(f"batch (size {batch_size}, {max_new} new tokens, context {max_context}) exceeds {bc}")
        max_new, max_context = bc.max_prompt_length, bc.max_cache_valid_length
    needed = [(ctx.current_length + round_up) // ps for ctx, _ in entries] if held_more else None
    return TablePlan(rows, lengths, needed, width, max_new, max_context, num_steps)
