"""Benchmarks only: every Python process started with RLJOB_BENCH_CPROFILE_DIR set (and this folder on PYTHONPATH)
profiles its main thread with cProfile and writes <dir>/<pid>.prof at exit. bench/warm_start.py's ``restoredprof``
pod uses it to see where a restored pod's first step goes (`python -m pstats <file>`)."""
import os

if os.environ.get("RLJOB_BENCH_CPROFILE_DIR"):
    import atexit
    import cProfile

    _profile = cProfile.Profile()
    _profile.enable()

    def _dump() -> None:
        _profile.disable()
        _profile.dump_stats(os.path.join(os.environ["RLJOB_BENCH_CPROFILE_DIR"], f"{os.getpid()}.prof"))

    atexit.register(_dump)
