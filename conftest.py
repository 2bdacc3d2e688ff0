"""Options of the eagle3-ref test suite. pytest reads command-line options only from a
conftest.py (or a plugin), hence this file: the size of the losslessness fuzzer.

    python -m pytest -q test_eagle3_ref.py                 # 30 fuzz cases, with the rest
    python -m pytest -m fuzz --fuzz-cases 1000             # the fuzzer alone, 1000 cases
"""

collect_ignore = ["runs"]  # generated files (and copies) live there, never tests


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=30,
                     help="random cases of the losslessness fuzzer (default 30)")
    parser.addoption("--fuzz-first-seed", type=int, default=0,
                     help="seed of the fuzzer's first case (cases are seeds FIRST, FIRST+1, ...)")


def pytest_configure(config):
    config.addinivalue_line("markers", "fuzz: the losslessness fuzzer (size: --fuzz-cases N)")
