"""What kind of op a StableHLO op is, by its full name: the tables the import, the search and the
cost model read alike (elementwise, compute-heavy, fused by XLA into one kernel)."""
from __future__ import annotations

# Ops that apply one function per element, by full name (operands have the result's shape, or
# are scalars: clamp bounds, a select's predicate). XLA expands the CHLO ones into StableHLO
# elementwise ops before it partitions; CHLO's broadcast_* ops broadcast implicitly and are left out.
ELEMENTWISE = frozenset({f"stablehlo.{k}" for k in (
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "compare", "complex", "convert", "cosine",
    "count_leading_zeros", "divide", "exponential", "exponential_minus_one", "floor", "imag",
    "is_finite", "log", "log_plus_one", "logistic", "maximum", "minimum", "multiply", "negate", "not",
    "or", "popcnt", "power", "real", "reduce_precision", "remainder", "round_nearest_afz",
    "round_nearest_even", "rsqrt", "select", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sine", "sqrt", "subtract", "tan", "tanh", "xor")} | {
    f"chlo.{k}" for k in (
    "_asin_acos_kernel", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bessel_i1e", "conj",
    "cosh", "digamma", "erf", "erf_inv", "erfc", "is_inf", "is_neg_inf", "is_pos_inf", "lgamma",
    "mulhi", "next_after", "polygamma", "sinh", "square", "tan", "zeta")})
COMPUTE_HEAVY = {"stablehlo.dot_general", "stablehlo.convolution"}


# Ops XLA fuses into one loop kernel with their fusible producers and readers (reductions take
# fused producers as their input too): the tensors between them never reach memory.
FUSIBLE = set(ELEMENTWISE) | {
    "stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.transpose", "stablehlo.iota",
    "stablehlo.constant", "sdy.sharding_constraint"}
FUSED_READERS = FUSIBLE | {"stablehlo.reduce"}
