"""The cost model: the machine (`cluster`), a collective's time (`collectives`), what XLA
combines and what its scheduler hides behind compute (`combining`, `overlap`), a plan's memory
(`memory`, `gemm_workspace`). A strategy's compute is priced where it is made (`space.strategies`)."""
