"""bench/common/options.py: a script names the shared options it takes with its own defaults and
gets each one's flag, type and help; a narrower help of its own where it gives one; a name that is
not shared (or a help for an option not taken) is refused."""

import argparse

import pytest


@pytest.fixture(scope="module")
def options(bench):
    return bench("bench.common.options")


def test_named_options_take_the_scripts_defaults_and_the_shared_types(options):
    ap = argparse.ArgumentParser()
    options.add_options(ap, threads=2, block_size=32, model=None, temperature=0.7, out="results")
    assert vars(ap.parse_args([])) == {"threads": 2, "block_size": 32, "model": None, "temperature": 0.7,
                                       "out": "results"}
    args = ap.parse_args(["--threads", "4", "--block-size", "16", "--model", "m.gguf", "--temperature", "0"])
    assert (args.threads, args.block_size, args.model, args.temperature) == (4, 16, "m.gguf", 0.0)
    with pytest.raises(SystemExit):
        ap.parse_args(["--threads", "two"])
    assert [a.option_strings for a in ap._actions[1:]] == [["--threads"], ["--block-size"], ["--model"],
                                                          ["--temperature"], ["--out"]]


def test_a_script_may_narrow_an_options_help(options):
    ap = argparse.ArgumentParser()
    options.add_options(ap, ctx=8192, seed=0, helps={"ctx": "llama-server total context (-c)"})
    helps = {a.dest: a.help for a in ap._actions}
    assert helps["ctx"] == "llama-server total context (-c)" and helps["seed"] == options.SHARED["seed"][1]


@pytest.mark.parametrize("defaults,helps", [({"threads": 2, "thread": 1}, None), ({"threads": 2}, {"seed": "x"})])
def test_an_option_not_shared_or_not_taken_is_refused(options, defaults, helps):
    with pytest.raises(ValueError, match="not a shared option"):
        options.add_options(argparse.ArgumentParser(), helps=helps, **defaults)
