"""What the host states about a batch before any of its rows is read."""


@fieldwise_init
struct BatchSummary(TrivialRegisterPassable):
    """What the host states about a batch before any of its rows is read, from
    a cache's fourth graph input: bounds on every row's new tokens, on its
    context including them, and on its cache length. A bound that the input
    does not state is `Int.MAX`.

    Attention checks every row against it before its first write and plans
    its work from it; on a GPU it is what sizes a launch without reading
    device memory."""

    var max_new_tokens: Int
    var max_context: Int
    var max_cache_length: Int

    @staticmethod
    def of_max_lengths(max_new_tokens: Int, max_context: Int) -> Self:
        """A paged cache's `max_lengths` row 0: (most new tokens of a row,
        longest context including them), exact or upper bounds."""
        return Self(max_new_tokens, max_context, Int.MAX)

    @staticmethod
    def of_is_cache_empty(is_cache_empty: Bool) -> Self:
        """A continuous-batching cache's `is_cache_empty`: when true, every
        cache length is 0."""
        return Self(Int.MAX, Int.MAX, 0 if is_cache_empty else Int.MAX)

    def check_row(self, row: Int, cache_length: Int, new_tokens: Int) raises:
        """Raises, naming the input it contradicts, unless batch row `row`
        (`cache_length` cached tokens and `new_tokens` new ones) keeps within
        the bounds."""
        if new_tokens > self.max_new_tokens:
            raise Error(
                t"row {row} has {new_tokens} new tokens but max_lengths[0, 0] is"
                t" {self.max_new_tokens}"
            )
        if cache_length + new_tokens > self.max_context:
            raise Error(
                t"row {row} has {cache_length} cached + {new_tokens} new ="
                t" {cache_length + new_tokens} tokens but max_lengths[0, 1] is {self.max_context}"
            )
        if cache_length > self.max_cache_length:
            raise Error(t"is_cache_empty is true but row {row} has cache_length {cache_length}")
