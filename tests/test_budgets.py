"""Size budgets from the README: the template stays readable as it grows."""

from conftest import REPO

TRAIN = REPO / "train"
BUDGETS = {"main.py": 300}  # every other module: 350
TOTAL = 2650  # 1,800; +300 job.py, resume.py; +200 FSDP, HSDP; +150 HF models; +150 streaming; +50 fast_reader


def code_lines(path):
    return len(path.read_text().splitlines())


def test_each_module_and_the_whole_stay_within_budget():
    sizes = {p.name: code_lines(p) for p in sorted(TRAIN.glob("*.py"))}
    over = {name: n for name, n in sizes.items() if n > BUDGETS.get(name, 350)}
    assert not over, f"over budget: {over}"
    assert sum(sizes.values()) <= TOTAL, sizes


def test_the_loop_body_stays_short():
    text = (TRAIN / "main.py").read_text()
    start = text.index("    while state.step < cfg.max_steps:")
    loop = text[start:text.index("# ---------------------------------------------------------------- save", start)]
    assert len(loop.splitlines()) <= 65
