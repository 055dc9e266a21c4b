#: 1 where copy_runs can write with non-temporal (streaming) stores (x86-64), else 0.
STREAMING_STORES: int
#: 1 where the extension was built with OpenMP (copy_runs shares runs among threads), else 0.
OPENMP: int

def copy_runs(table: int, count: int, streaming: bool, threads: int = 1, /) -> None:
    """Copy ``count`` runs of the int64 table at address ``table`` (destination, source, bytes), GIL released.

    ``threads`` > 1 shares the runs out among the calling thread's OpenMP team (when ``OPENMP``).
    """
