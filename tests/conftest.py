import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:  # tiny models: one thread is as fast, and stays fast on a shared machine
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass


# Module fixtures shared by the CLI tests (a module may define its own of the same name).
import pytest  # noqa: E402
from clitools import spell_records, write_jsonl  # noqa: E402
from tiny import save_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def mars_home(tmp_path_factory):
    """The tests' own cache directory: the cost curves and path choices they measure never
    land in the user's. The default model converted there before is reused (read, not written),
    and what inductor compiled is shared with the user's cache (content-keyed code, no measurement)."""
    from mars.checkpoint.default_model import cache_root

    real = cache_root()
    home = tmp_path_factory.mktemp("mars_home")
    if (real / "models").is_dir():
        (home / "models").symlink_to(real / "models", target_is_directory=True)
    # What inductor compiled (keyed by the graphs' contents): shared, so a second run starts warm.
    try:
        (real / "inductor").mkdir(parents=True, exist_ok=True)
        (home / "inductor").symlink_to(real / "inductor", target_is_directory=True)
    except OSError:
        pass
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MARS_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama base model directory."""
    return save_model(tmp_path_factory.mktemp("tiny") / "base", "llama", seed=0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A data directory with 20 "Spell from c" -> "c d e ..." training records."""
    d = tmp_path_factory.mktemp("data") / "spell"
    write_jsonl(d / "train.jsonl", spell_records())
    return d
