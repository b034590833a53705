"""lm-evaluation-harness on the template's models (train/harness.py), offline: a small multiple-choice task
declared in the harness's YAML task format, on the built-in GPT (bytes) and on the tiny Hugging Face Llama
(a BPE tokenizer). Each score must equal a hand computation of the same comparison: for every question, the
choice whose continuation " <choice>" has the highest summed log-probability after the question."""

import importlib.util
import json
import os

import pytest
import torch

import harness
from conftest import REPO
from errors import ConfigError
from model import build_model
from run_config import config_class

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


INSTALLED = importlib.util.find_spec("lm_eval") is not None
# CI installs the optional requirements-eval.txt: there a missing harness is a failure, not a skip
needs_harness = pytest.mark.skipif(
    not INSTALLED and not os.environ.get("CI"),
    reason=f"lm-evaluation-harness is an optional install: {harness.INSTALL}",
)

QUESTIONS = [
    ("import", ["os", "the", "!!"], 0),
    ("def main", ["():", "{}", "zz"], 0),
    ("return", ["None", "Nnne", "xq"], 1),
    ("for i in", ["range", "rqnge", "##"], 2),
    ("class Foo", ["(object):", "[]", "%%"], 1),
    ("if __name__ ==", ['"__main__":', "7", "&&"], 0),
    ("while", ["True:", "ttt", "()"], 2),
    ("print(", ["'hello')", "x", "]]]"], 1),
    ("self.", ["value", "a b", "__"], 0),
    ("# a comment", ["\n", "~", "??"], 2),
]


def write_task(folder, name="tiny_mc") -> str:
    """The task in the harness's own format: a YAML file naming a local JSON lines file."""
    data = folder / f"{name}.jsonl"
    with open(data, "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return name


@torch.no_grad()
def accuracy_by_hand(model, encode) -> float:
    """The harness's comparison, written out: the context's tokens, then the whole text's tokens after
    them as the continuation; the summed log-softmax of each continuation token; the argmax choice."""
    right = 0
    for question, choices, answer in QUESTIONS:
        scores = []
        for choice in choices:
            context = encode(question)
            continuation = encode(question + " " + choice)[len(context) :]
            tokens = torch.tensor([context + continuation])
            log_probs = model(input_ids=tokens[:, :-1]).logits[0].float().log_softmax(-1)
            picked = log_probs[-len(continuation) :].gather(
                1, tokens[0, -len(continuation) :, None]
            )
            scores.append(picked.sum().item())
        right += max(range(len(choices)), key=scores.__getitem__) == answer
    return right / len(QUESTIONS)


@needs_harness
@pytest.mark.shipped  # the shipped GPT over bytes
def test_the_built_in_gpt_scores_as_computed_by_hand(tmp_path):
    cfg = RunConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    task = write_task(tmp_path)
    scores, results = harness.run_tasks(model, None, cfg.block_size, [task], str(tmp_path))
    assert results["results"][task]["sample_len"] == len(QUESTIONS)
    expected = accuracy_by_hand(model, lambda text: list(text.encode()))
    assert scores == {f"{task}/acc": pytest.approx(expected, abs=1e-12)}
    assert 0 < expected < 1  # a comparison that could have gone either way on some questions


@needs_harness
def test_a_hugging_face_model_scores_as_computed_by_hand(tmp_path, tiny_llama, bpe_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer)
    task = write_task(tmp_path)
    scores, _ = harness.run_tasks(model, tokenizer, 64, [task], str(tmp_path))
    expected = accuracy_by_hand(
        model, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    assert scores == {f"{task}/acc": pytest.approx(expected, abs=1e-12)}


@needs_harness
@pytest.mark.shipped  # the shipped GPT over bytes
def test_batched_scoring_equals_one_at_a_time_and_keeps_the_last_block_size_tokens():
    cfg = RunConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)
    torch.manual_seed(1)
    model = build_model(cfg).eval()
    lm = harness.HarnessLM(model, None, block_size=8, batch_size=3)
    pairs = [
        (list(b"abc"), list(b"de")),
        (list(b"a much longer context"), list(b"xyz")),
        ([10], [65]),
    ]
    batched = lm.score(pairs)
    single = [harness.HarnessLM(model, None, 8, batch_size=1).score([pair])[0] for pair in pairs]
    assert [round(ll, 5) for ll, _ in batched] == [round(ll, 5) for ll, _ in single]
    tokens = list(b"a much longer context") + list(b"xyz")
    inputs = torch.tensor([tokens[-9:-1]])  # the window the model can see: 8 tokens
    with torch.no_grad():
        log_probs = model(input_ids=inputs).logits[0].log_softmax(-1)
    by_hand = log_probs[-3:].gather(1, torch.tensor(tokens[-3:])[:, None]).sum().item()
    assert batched[1][0] == pytest.approx(by_hand, rel=1e-5)


def test_without_the_harness_installed_the_error_is_one_line_naming_the_command(monkeypatch):
    monkeypatch.setattr(harness.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as error:
        harness.check_tasks("eval_tasks", ["hellaswag"], "")
    assert str(error.value) == (
        "eval_tasks needs lm-evaluation-harness, an optional install: pip install -r requirements-eval.txt"
    )


@needs_harness
@pytest.mark.slow  # indexes the harness's 15,000 task files
def test_an_unknown_task_or_task_path_is_one_line(tmp_path):
    write_task(tmp_path)
    with pytest.raises(
        ConfigError, match="eval_tasks: no task 'tiny_mcq' in lm-evaluation-harness or under"
    ):
        harness.check_tasks("eval_tasks", ["tiny_mcq"], str(tmp_path))
    with pytest.raises(ConfigError, match="the task path is not an existing file or folder"):
        harness.check_tasks("eval_tasks", ["tiny_mc"], str(tmp_path / "absent"))
    harness.check_tasks("eval_tasks", ["tiny_mc"], str(tmp_path))  # found: no error


@needs_harness
def test_the_evaluate_script_refuses_an_unknown_task_in_one_line_with_exit_2(
    tmp_path, capsys, monkeypatch
):
    """A bad input, as the training refuses one: one `error:` line, exit 2. (The harness's index of
    its own tasks, which takes seconds, is an empty one here: check_tasks against the real index is
    the test above.)"""
    from types import SimpleNamespace

    monkeypatch.setattr(harness, "harness_tasks", lambda: SimpleNamespace(all_tasks=set()))
    spec = importlib.util.spec_from_file_location("evaluate", REPO / "scripts" / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    with pytest.raises(SystemExit) as stopped:
        evaluate.main([str(tmp_path), "--tasks", "x"])
    assert stopped.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        "error: --tasks: no task 'x' in lm-evaluation-harness (lm_eval --tasks list shows them)"
    ]


@needs_harness
@pytest.mark.shipped  # the shipped GPT over bytes
def test_rolling_log_likelihood_scores_every_token_once_with_the_context_its_window_allows():
    """Perplexity tasks (loglikelihood_rolling): a text of 21 bytes through a block of 8 is three
    disjoint windows; each token is scored once, after the up to 8 tokens before it (a newline, the
    end of a document, before the first). By hand: the same sums from plain forward passes."""
    from types import SimpleNamespace

    model, lm = tiny_gpt_and_its_harness_lm(seed=2)
    text = "rolling windows, once"
    tokens = list(text.encode())
    stream = [ord("\n"), *tokens]  # stream[j + 1] is tokens[j]
    by_hand = 0.0
    with torch.no_grad():
        for start in range(0, len(tokens), 8):
            end = min(start + 8, len(tokens))  # this window scores tokens[start:end]
            first = max(0, end - 8)
            log_probs = model(input_ids=torch.tensor([stream[first:end]])).logits[0].log_softmax(-1)
            by_hand += sum(log_probs[j - first, stream[j + 1]].item() for j in range(start, end))
    (rolling,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    assert rolling == pytest.approx(by_hand, rel=1e-5)


@needs_harness
@pytest.mark.shipped
def test_generation_is_greedy_within_the_block_and_stops_at_the_first_until_string():
    from types import SimpleNamespace

    model, lm = tiny_gpt_and_its_harness_lm(seed=3)
    context = "def generate"
    window = list(context.encode())
    expected = []
    with torch.no_grad():
        for _ in range(6):
            logits = model(input_ids=torch.tensor([window[-8:]])).logits
            expected.append(int(logits[0, -1].argmax()))
            window.append(expected[-1])
    request = SimpleNamespace(args=(context, {"until": [], "max_gen_toks": 6}))
    (generated,) = lm.generate_until([request])
    assert generated == bytes(expected).decode("utf-8", errors="replace")
    stop = generated[3]
    request = SimpleNamespace(args=(context, {"until": [stop], "max_gen_toks": 6}))
    assert lm.generate_until([request]) == [generated.split(stop)[0]]


def tiny_gpt_and_its_harness_lm(seed: int):
    """The shipped GPT over bytes, 1 layer, a block of 8, in eval mode, and the harness's LM over it."""
    torch.manual_seed(seed)
    model = build_model(RunConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)).eval()
    return model, harness.HarnessLM(model, None, block_size=8)
