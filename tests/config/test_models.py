"""The `[[models]]` form refused in one line naming the file, the key and the fix: one form
or the other, unique names and aliases, names that are a unit and URL part, no shared
placement keys, per-node only, and each table's engine keys (engines/keys.py) as
`[server]`'s; and what a table's optional keys become in its view."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.config.models import find, served_models
from numad_infer.config.schema import Config, ModelSection, ModelView
from numad_infer.engines.keys import check_engine_keys
from numad_infer.errors import ConfigError

SRC = "/etc/numa-infer.toml"


def models(*tables: str, head: str = "") -> str:
    """A file with `head` first, then one [[models]] table per item (its keys after name and path)."""
    text = head
    for k, extra in enumerate(tables):
        text += f'\n[[models]]\nname = "m{k}"\npath = "/m{k}.gguf"\n{extra}\n'
    return text


def refused(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        check_engine_keys(parse_config(text, SRC), SRC)
    message = str(info.value)
    assert "\n" not in message and message.startswith(SRC + ": ")
    return message




def test_two_models_with_one_name_are_refused() -> None:
    text = '[[models]]\nname = "chat"\npath = "/a.gguf"\n[[models]]\nname = "chat"\npath = "/b.gguf"\n'
    assert refused(text) == (f'{SRC}: models[1].name = "chat": "chat" is already models[0]\'s name; every name and '
                             "alias must route to one model: rename one of them")


def test_an_alias_equal_to_another_models_name_or_alias_is_refused() -> None:
    assert 'models[1].aliases = "m0": "m0" is already models[0]\'s name' in refused(models("", 'aliases = ["m0"]'))
    text = models('aliases = ["gpt-4o"]', 'aliases = ["gpt-4o"]')
    assert 'models[1].aliases = "gpt-4o": "gpt-4o" is already models[0]\'s alias' in refused(text)
    assert "models[0].aliases = \"m0\"" in refused(models('aliases = ["m0"]'))  # its own name twice


@pytest.mark.parametrize("name", ["a b", "chat/v1", "7b", "-x", "x" * 65, "", "é", "a@b", "a%2F", "a\\\\b"])
def test_a_name_that_cannot_be_a_unit_or_url_part_is_refused(name: str) -> None:
    message = refused(f'[[models]]\nname = "{name}"\npath = "/a.gguf"\n')
    assert "models[0].name" in message and "must be 1-64 letters, digits or . _ : -, starting with a letter" in message
    alias = refused(f'[[models]]\nname = "ok"\naliases = ["{name}"]\npath = "/a.gguf"\n')
    assert "models[0].aliases[0]" in alias and "starting with a letter" in alias


def test_good_names_are_accepted() -> None:
    config = parse_config(models('aliases = ["gpt-4o-mini", "llama3.1:8b", "a_b"]'), SRC)
    assert served_models(config)[0].ids == ("m0", "gpt-4o-mini", "llama3.1:8b", "a_b")


def test_model_and_models_together_or_neither_are_refused() -> None:
    both = refused(models("", head='[model]\npath = "/m.gguf"\n'))
    assert both == (f"{SRC}: models: and [model] are both set: use [model] for one model or [[models]] for several "
                    "(move [model]'s keys into a [[models]] table with a name), not both")
    neither = refused("[placement]\nsmt = false\n")
    assert neither.startswith(f"{SRC}: model: is required: a [model] table") and "[[models]]" in neither


@pytest.mark.parametrize("key, value", [("nodes", "[0]"), ("nodes", '"all"'), ("instances_per_node", "2")])
def test_placement_keys_each_model_has_are_refused_beside_models(key: str, value: str) -> None:
    message = refused(models("", head=f"[placement]\n{key} = {value}\n"))
    assert message.startswith(f"{SRC}: placement.{key} = ")
    assert f"move it into the [[models]] tables (models[i].{key})" in message


def test_interleave_is_refused_with_models() -> None:
    message = refused(models("", head='[placement]\nmode = "interleave"\n'))
    assert message.startswith(f'{SRC}: placement.mode = "interleave": ') and 'use "per-node"' in message


def test_a_models_parallel_is_llama_servers_only() -> None:
    text = models("parallel = 4", head='[server]\nengine = "llama-cpp-python"\n')
    assert refused(text) == (f'{SRC}: models[0].parallel = 4: applies to server.engine = "llama-server" only, and '
                             'server.engine is "llama-cpp-python"; remove the key from this [[models]] table or '
                             "change the engine")
    config = parse_config(models("", "parallel = 4"), SRC)
    check_engine_keys(config, SRC)  # llama-server, the default engine
    assert [m.view.server.parallel for m in served_models(config)] == [1, 4]


@pytest.mark.parametrize("engine", ["llama-server", "llama-cpp-python"])
@pytest.mark.parametrize("args", [["--api-key", "sk-SECRET-1"], ["--api_key=sk-SECRET-2"], ["-v", "--api-key-file=/k"]])
def test_an_api_key_flag_in_a_models_extra_args_is_refused_without_echoing_it(engine: str, args: list[str]) -> None:
    text = models("", f"extra_args = {json.dumps(args)}", head=f'[server]\nengine = "{engine}"\n')
    message = refused(text)
    index = next(i for i, a in enumerate(args) if a.startswith("--api"))
    assert message.startswith(f"{SRC}: models[1].extra_args: item {index} is {args[index].partition('=')[0]}")
    assert "server.api_key_file" in message and "SECRET" not in message


def test_a_bad_item_of_a_models_extra_args_is_named_never_shown() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(models('extra_args = ["--x", "sk-SECRET\\n"]'), SRC)
    assert str(info.value).startswith(f"{SRC}: models[0].extra_args[1]: contains a control character")
    assert "SECRET" not in str(info.value)


def test_a_models_threads_and_extra_args_are_its_views_own() -> None:
    text = models('threads = 24\nthreads_batch = "auto"\nextra_args = ["--batch-size", "256"]', "",
                  head='[placement]\nthreads = 4\nthreads_batch = 8\n[server]\nextra_args = ["--mlock"]\n')
    config = parse_config(text, SRC)
    big, small = (find(served_models(config), name).view for name in ("m0", "m1"))
    assert (big.placement.threads, big.placement.threads_batch) == (24, "auto")
    assert (small.placement.threads, small.placement.threads_batch) == (4, 8)
    assert big.server.extra_args == ["--mlock", "--batch-size", "256"] and small.server.extra_args == ["--mlock"]
    assert big.model.path == "/m0.gguf" and big.models == [] and config.model is None
    with pytest.raises(ConfigError, match=r"models\[0\]\.threads = 0: "):
        parse_config(models("threads = 0"), SRC)


@pytest.mark.parametrize("text", [
    '[model]\npath = "/one.gguf"\nname = "one"\n[server]\nparallel = 2\n',
    models("parallel = 3", 'threads = 2\nextra_args = ["--x"]'),
], ids=["[model]", "[[models]]"])
def test_every_served_models_view_is_a_model_view_with_its_model_and_the_files_values(text: str) -> None:
    config = parse_config(text, SRC)
    served = served_models(config)
    for model in served:
        view = model.view
        assert type(view) is ModelView and isinstance(view.model, ModelSection)
        assert view.model.path.endswith(".gguf") and view.models == []
        # Built from the validated file, not validated again: the same section objects where
        # the model sets nothing of its own, and validating the view's values gives it back.
        assert view.monitor is config.monitor and view.frontend is config.frontend
        assert ModelView.model_validate(view.model_dump()) == view
        assert "model" in view.model_fields_set
    if config.model is not None:
        (only,) = served
        assert only.view.model is config.model
        assert dict(only.view) == dict(config) and only.view.model_fields_set == config.model_fields_set
    else:
        assert [m.view.model.path for m in served] == [e.path for e in config.models]


def test_a_whole_config_has_no_one_model_and_a_view_has_every_key_of_it() -> None:
    assert not hasattr(Config, "one_model")
    assert not hasattr(parse_config(models(""), SRC), "one_model")
    assert list(ModelView.model_fields) == list(Config.model_fields)
    assert ModelView.model_fields["model"].is_required() and not Config.model_fields["model"].is_required()


READS_ONE_MODEL = """\
from numad_infer.config.schema import Config, ModelView
from numad_infer.engines import engine_of
from numad_infer.plan.model import Instance


def whole(config: Config, instance: Instance) -> list[str]:
    return engine_of(config).argv(config, instance)


def one(view: ModelView, instance: Instance) -> list[str]:
    return engine_of(view).argv(view, instance) + [view.model.path]


def whole_model(config: Config) -> str:
    return config.model.path
"""


def test_the_type_checker_refuses_a_whole_config_where_one_model_is_read(tmp_path: Path) -> None:
    """What issue 37 found failing at run time (`one_model` of a [[models]] file) is mypy's
    error now: a whole Config handed to what reads one model, or its `model` read unchecked."""
    pytest.importorskip("mypy.api")
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "reads_one_model.py").write_text(READS_ONE_MODEL)
    found = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"), "--cache-dir",
         str(tmp_path / "cache"), "--follow-imports", "silent", str(tmp_path / "reads_one_model.py")],
        cwd=root, env={**os.environ, "MYPYPATH": str(root)}, capture_output=True, text=True, timeout=600)
    errors = re.findall(r"reads_one_model\.py:(\d+): error: .*\[([a-z-]+)\]$", found.stdout, re.MULTILINE)
    assert errors == [("7", "arg-type"), ("15", "union-attr")], found.stdout + found.stderr

