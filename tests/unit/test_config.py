"""Config defaults, precedence (flag > env > file > default), conversion and errors."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import platformdirs
import pytest

from swarmd.config import Config, ServeSpec, load_config
from swarmd.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "swarmd.example.toml"
FIELD_NAMES = [f.name for f in dataclasses.fields(Config)]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "swarmd.toml"
    path.write_text(text, encoding="utf-8")
    return path


# --- defaults --------------------------------------------------------------------------


def test_defaults() -> None:
    config = Config()
    assert config.host == "127.0.0.1"
    assert config.port == 8800
    assert config.model == "smollm2-135m-instruct"
    assert config.data_dir == Path(platformdirs.user_data_dir("swarmd"))
    assert config.cache_dir == Path(platformdirs.user_cache_dir("swarmd"))
    assert config.dtype == "auto"
    assert config.weights == "auto"
    assert config.torch_threads == 0
    assert config.prefill_chunk_tokens == 256
    assert config.max_sessions == 32
    assert config.kv_budget_tokens == 0
    assert config.prefix_cache_tokens == -1
    assert config.queue_timeout_s == 300.0
    assert config.step_timeout_s == 60.0
    assert config.max_body_bytes == 1_048_576
    assert config.default_temperature == 1.0
    assert config.log_level == "INFO"


def loaded_defaults() -> Config:
    """What load_config gives with nothing set: Config() with the per-port data dir."""
    root = Path(platformdirs.user_data_dir("swarmd"))
    return dataclasses.replace(Config(), data_dir=root / "node-8800")


def test_no_layers_gives_defaults() -> None:
    assert load_config({}, None, {}) == loaded_defaults()


def test_each_port_gets_its_own_data_dir() -> None:
    root = Path(platformdirs.user_data_dir("swarmd"))
    assert load_config({"port": 8801}, None, {}).data_dir == root / "node-8801"
    assert load_config({"data_dir": "/x"}, None, {}).data_dir == Path("/x")


def test_dir_defaults_are_computed_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platformdirs, "user_data_dir", lambda app: f"/data/{app}")
    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda app: f"/cache/{app}")
    config = Config()
    assert config.data_dir == Path("/data/swarmd")
    assert config.cache_dir == Path("/cache/swarmd")


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().port = 1  # type: ignore[misc]


# --- precedence ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        ({"flag", "env", "file"}, 1003),
        ({"env", "file"}, 1002),
        ({"flag", "file"}, 1003),
        ({"file"}, 1001),
        ({"flag", "env"}, 1003),
        (set(), 8800),
    ],
)
def test_precedence(tmp_path: Path, layers: set[str], expected: int) -> None:
    config_file = write(tmp_path, "port = 1001\n") if "file" in layers else None
    env = {"SWARMD_PORT": "1002"} if "env" in layers else {}
    flags = {"port": 1003} if "flag" in layers else {}
    assert load_config(flags, config_file, env).port == expected


def test_precedence_is_per_field(tmp_path: Path) -> None:
    config_file = write(tmp_path, 'host = "0.0.0.0"\nport = 1001\nmodel = "from-file"\n')
    env = {"SWARMD_PORT": "1002", "SWARMD_MODEL": "from-env"}
    config = load_config({"model": "from-flag"}, config_file, env)
    assert config.model == "from-flag"
    assert config.port == 1002
    assert config.host == "0.0.0.0"
    assert config.dtype == "auto"


def test_none_flags_are_ignored() -> None:
    config = load_config({"port": None, "host": None}, None, {"SWARMD_PORT": "1002"})
    assert config.port == 1002
    assert config.host == "127.0.0.1"


def test_config_file_from_env(tmp_path: Path) -> None:
    path = write(tmp_path, "max_sessions = 3\n")
    assert load_config({}, None, {"SWARMD_CONFIG": str(path)}).max_sessions == 3


def test_config_file_argument_beats_env(tmp_path: Path) -> None:
    given = write(tmp_path, "max_sessions = 3\n")
    other = tmp_path / "other.toml"
    other.write_text("max_sessions = 4\n", encoding="utf-8")
    assert load_config({}, given, {"SWARMD_CONFIG": str(other)}).max_sessions == 3


def test_empty_config_env_means_no_file() -> None:
    assert load_config({}, None, {"SWARMD_CONFIG": ""}) == loaded_defaults()


def test_unrelated_env_is_ignored() -> None:
    env = {"PORT": "1", "SWARMD_UNKNOWN": "x", "HOME": "/nowhere"}
    assert load_config({}, None, env) == loaded_defaults()


# --- type conversion -------------------------------------------------------------------


def test_env_strings_are_converted() -> None:
    env = {
        "SWARMD_PORT": "9000",
        "SWARMD_QUEUE_TIMEOUT_S": "2.5",
        "SWARMD_STEP_TIMEOUT_S": "7",
        "SWARMD_MODEL": "org/some-model",
        "SWARMD_CACHE_DIR": "~/swarmd-cache",
        "SWARMD_DATA_DIR": "/srv/swarmd",
    }
    config = load_config({}, None, env)
    assert config.port == 9000
    assert isinstance(config.port, int)
    assert config.queue_timeout_s == 2.5
    assert config.step_timeout_s == 7.0
    assert isinstance(config.step_timeout_s, float)
    assert config.model == "org/some-model"
    assert config.cache_dir == Path.home() / "swarmd-cache"
    assert config.data_dir == Path("/srv/swarmd")


def test_file_values_are_converted(tmp_path: Path) -> None:
    path = write(tmp_path, 'queue_timeout_s = 5\ndata_dir = "~/state"\nmax_body_bytes = 2_048\n')
    config = load_config({}, path, {})
    assert config.queue_timeout_s == 5.0
    assert isinstance(config.queue_timeout_s, float)
    assert config.data_dir == Path.home() / "state"
    assert config.max_body_bytes == 2048


def test_flag_values_are_converted(tmp_path: Path) -> None:
    flags = {"port": "9001", "data_dir": Path("~/d"), "cache_dir": "~/c", "step_timeout_s": 3}
    config = load_config(flags, None, {})
    assert config.port == 9001
    assert config.data_dir == Path.home() / "d"
    assert config.cache_dir == Path.home() / "c"
    assert config.step_timeout_s == 3.0
    assert isinstance(config.step_timeout_s, float)


def test_config_file_path_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path, "port = 1234\n")
    assert load_config({}, Path("~/swarmd.toml"), {}).port == 1234


# --- errors ----------------------------------------------------------------------------


def test_unknown_toml_key(tmp_path: Path) -> None:
    path = write(tmp_path, "prot = 1\n")
    with pytest.raises(ConfigError, match="prot") as info:
        load_config({}, path, {})
    assert str(path) in str(info.value)
    assert "port" in str(info.value)  # the suggestion


def test_toml_table_is_unknown_key(tmp_path: Path) -> None:
    path = write(tmp_path, "[api]\nport = 1\n")
    with pytest.raises(ConfigError, match="'api'"):
        load_config({}, path, {})


@pytest.mark.parametrize(
    "line",
    [
        'port = "8800"',  # str for int
        "port = 8800.0",  # float for int
        "port = true",  # bool for int
        "queue_timeout_s = false",  # bool for float
        'queue_timeout_s = "30"',  # str for float
        "host = 127",  # int for str
        "data_dir = 1",  # int for Path
        "model = [1, 2]",  # array for str
    ],
)
def test_wrong_type_in_toml(tmp_path: Path, line: str) -> None:
    path = write(tmp_path, line + "\n")
    key = line.split(" =")[0]
    with pytest.raises(ConfigError, match=key) as info:
        load_config({}, path, {})
    assert str(path) in str(info.value)


def test_wrong_type_in_flag() -> None:
    with pytest.raises(ConfigError, match="flag --max-sessions"):
        load_config({"max_sessions": 2.5}, None, {})


def test_unknown_flag() -> None:
    with pytest.raises(ConfigError, match="prot"):
        load_config({"prot": 1}, None, {})


@pytest.mark.parametrize(
    ("var", "text"),
    [
        ("SWARMD_PORT", "eighty"),
        ("SWARMD_PORT", "80.5"),
        ("SWARMD_PORT", ""),
        ("SWARMD_MAX_SESSIONS", "1e3"),
        ("SWARMD_STEP_TIMEOUT_S", "soon"),
    ],
)
def test_unparsable_env(var: str, text: str) -> None:
    with pytest.raises(ConfigError, match=var):
        load_config({}, None, {var: text})


def test_unparsable_flag_string() -> None:
    with pytest.raises(ConfigError, match="flag --port"):
        load_config({"port": "x"}, None, {})


def test_missing_config_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config({}, path, {})
    assert str(path) in str(info.value)


def test_missing_config_file_from_env(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match="SWARMD_CONFIG") as info:
        load_config({}, None, {"SWARMD_CONFIG": str(path)})
    assert str(path) in str(info.value)


def test_config_file_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path))):
        load_config({}, tmp_path, {})


@pytest.mark.parametrize("text", ["port = \n", "port = 1\nport = 2\n", "[[\n"])
def test_invalid_toml(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config({}, path, {})
    assert str(path) in str(info.value)


def test_toml_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "swarmd.toml"
    path.write_bytes(b'model = "\xff"\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config({}, path, {})


OUT_OF_RANGE = [
    ("port", "-1"),
    ("port", "65536"),
    ("dtype", "float64"),
    ("dtype", "fp16"),
    ("weights", "int3"),
    ("weights", "float32"),
    ("torch_threads", "-1"),
    ("prefill_chunk_tokens", "0"),
    ("max_sessions", "0"),
    ("queue_timeout_s", "0"),
    ("queue_timeout_s", "-1.5"),
    ("queue_timeout_s", "nan"),
    ("queue_timeout_s", "inf"),
    ("step_timeout_s", "0"),
    ("step_timeout_s", "-0.1"),
    ("max_body_bytes", "1023"),
    ("log_level", "TRACE"),
    ("log_level", "debug"),
    ("host", ""),
    ("model", ""),
    ("default_temperature", "-0.5"),
    ("reachability", "maybe"),
    ("reachability", "Public"),
]


@pytest.mark.parametrize(("name", "text"), OUT_OF_RANGE)
def test_out_of_range_from_env(name: str, text: str) -> None:
    var = "SWARMD_" + name.upper()
    with pytest.raises(ConfigError, match=name) as info:
        load_config({}, None, {var: text})
    assert var in str(info.value)


def test_out_of_range_from_flag() -> None:
    with pytest.raises(ConfigError, match="flag --prefill-chunk-tokens"):
        load_config({"prefill_chunk_tokens": 0}, None, {})


def test_out_of_range_from_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'dtype = "int8"\n')
    with pytest.raises(ConfigError, match="dtype") as info:
        load_config({}, path, {})
    assert str(path) in str(info.value)


def test_bad_value_in_lower_layer_is_still_an_error(tmp_path: Path) -> None:
    # A flag overrides the env var, so the bad env value is never read.
    assert load_config({"port": 9000}, None, {"SWARMD_PORT": "x"}).port == 9000
    # An unknown key in the file is an error even when nothing else in it is used.
    path = write(tmp_path, "bogus = 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        load_config({"port": 9000}, path, {})


# --- the example file ------------------------------------------------------------------

SETTING = re.compile(r"^#?\s*(\w+)\s*=\s*(.+)$")


def example_settings() -> dict[str, str]:
    """`key = value` lines of the example file, commented or not, for Config fields."""
    found: dict[str, str] = {}
    for line in EXAMPLE.read_text(encoding="utf-8").splitlines():
        match = SETTING.match(line)
        if match and match.group(1) in FIELD_NAMES:
            found[match.group(1)] = match.group(2)
    return found


def test_example_loads_as_defaults() -> None:
    assert load_config({}, EXAMPLE, {}) == loaded_defaults()


def test_example_names_every_field() -> None:
    assert sorted(example_settings()) == sorted(FIELD_NAMES)


def test_example_values_are_the_defaults(tmp_path: Path) -> None:
    # Uncomment every setting (bar the platform-dependent dirs) and load it.
    settings = example_settings()
    del settings["data_dir"], settings["cache_dir"]
    path = write(tmp_path, "".join(f"{key} = {value}\n" for key, value in settings.items()))
    assert load_config({}, path, {}) == loaded_defaults()


def test_bootstrap_from_each_layer(tmp_path: Path) -> None:
    addr = "/ip4/127.0.0.1/tcp/8810/p2p/12D3KooWA4Xop1JaT3MHxwYMkCepYsv4iPVopMXwCz5iHYdBfeSB"
    other = addr.replace("8810", "8811")
    env = {"SWARMD_BOOTSTRAP": f"{addr}, {other}"}
    assert load_config({}, None, env).bootstrap == (addr, other)
    toml = tmp_path / "c.toml"
    toml.write_text(f'bootstrap = ["{addr}"]\n')
    assert load_config({}, toml, {}).bootstrap == (addr,)
    assert load_config({"bootstrap": (other,)}, toml, env).bootstrap == (other,)
    toml.write_text("bootstrap = [1]\n")
    with pytest.raises(ConfigError, match="list of strings"):
        load_config({}, toml, {})
    with pytest.raises(ConfigError, match="multiaddr"):
        load_config({}, None, {"SWARMD_BOOTSTRAP": "127.0.0.1:8810"})


def test_layers_and_p2p_port_ranges() -> None:
    assert load_config({"layers": "0:15"}, None, {}).layers == "0:15"
    with pytest.raises(ConfigError, match="layers"):
        load_config({"layers": "15"}, None, {})
    with pytest.raises(ConfigError, match="p2p_port"):
        load_config({}, None, {"SWARMD_P2P_PORT": "-2"})


def test_bool_fields_from_env_file_and_flags(tmp_path: Path) -> None:
    for text, value in (("1", True), ("yes", True), ("On", True), ("0", False), ("no", False)):
        config = load_config({}, None, {"SWARMD_REQUIRE_API_TOKEN": text})
        assert config.require_api_token is value
    with pytest.raises(ConfigError, match="SWARMD_ALLOW_OPEN_API"):
        load_config({}, None, {"SWARMD_ALLOW_OPEN_API": "maybe"})
    assert load_config({}, write(tmp_path, "allow_open_api = true\n"), {}).allow_open_api
    with pytest.raises(ConfigError, match="expected bool"):
        load_config({}, write(tmp_path, "allow_open_api = 1\n"), {})
    with pytest.raises(ConfigError, match="origins like"):
        load_config({}, write(tmp_path, 'allowed_origins = ["https://a.example/"]\n'), {})


# --- the models a node serves ----------------------------------------------------------


def test_served_is_the_flat_model_by_default() -> None:
    config = Config(model="m", layers="0:4", weights="int8", dtype="float32")
    assert config.served() == (ServeSpec("m", "0:4", "int8", "float32", None),)
    assert Config().served() == (ServeSpec("smollm2-135m-instruct"),)


def test_served_is_the_serve_list_when_given() -> None:
    specs = (ServeSpec("a"), ServeSpec("b", layers="auto"))
    assert Config(model="ignored", serve=specs).served() == specs


def test_served_is_empty_with_no_model() -> None:
    assert Config(no_model=True).served() == ()
    assert Config(no_model=True, serve=(ServeSpec("a"),)).served() == ()


def test_for_model_narrows_to_one_spec() -> None:
    config = Config(memory_budget_gb=8.0, serve=(ServeSpec("a"), ServeSpec("b")))
    spec = ServeSpec("b", layers="0:12", weights="int4", dtype="bfloat16")
    narrowed = config.for_model(spec)
    assert narrowed == dataclasses.replace(
        config,
        model="b",
        layers="0:12",
        weights="int4",
        dtype="bfloat16",
        memory_budget_gb=8.0,
        serve=(),
    )
    assert narrowed.served() == (ServeSpec("b", "0:12", "int4", "bfloat16", None),)
    assert config.for_model(ServeSpec("a", memory_budget_gb=2.5)).memory_budget_gb == 2.5


SERVE_TOML = """\
port = 9000

[[serve]]
model = "smollm2-135m-instruct"

[[serve]]
model = "/models/q.gguf"
layers = "0:12"
weights = "int8"
dtype = "float32"
memory_budget_gb = 3
"""


def test_serve_tables_from_toml(tmp_path: Path) -> None:
    config = load_config({}, write(tmp_path, SERVE_TOML), {})
    assert config.port == 9000
    assert config.serve == (
        ServeSpec("smollm2-135m-instruct"),
        ServeSpec("/models/q.gguf", "0:12", "int8", "float32", 3.0),
    )
    assert isinstance(config.serve[1].memory_budget_gb, float)
    assert config.served() == config.serve


def test_serve_as_inline_tables_and_empty(tmp_path: Path) -> None:
    text = 'serve = [{ model = "a" }, { model = "b", layers = "auto" }]\n'
    assert load_config({}, write(tmp_path, text), {}).serve == (
        ServeSpec("a"),
        ServeSpec("b", layers="auto"),
    )
    assert load_config({}, write(tmp_path, "serve = []\n"), {}) == loaded_defaults()


def test_serve_flag_replaces_the_file_list(tmp_path: Path) -> None:
    flag = (ServeSpec("x", memory_budget_gb=1), ServeSpec("y", layers="2:4"))
    config = load_config({"serve": flag}, write(tmp_path, SERVE_TOML), {})
    assert config.serve == (ServeSpec("x", memory_budget_gb=1.0), ServeSpec("y", layers="2:4"))


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ('model = "a"\nlayer = "0:4"', r"unknown key 'layer' in \[\[serve\]\] table 2 .*'layers'"),
        ('model = "a"\nbogus = 1', r"unknown key 'bogus' in \[\[serve\]\] table 2"),
        ('model = "a"\nlayers = "15"', r"layers must be START:END.*\[\[serve\]\] table 2"),
        ('model = "a"\nweights = "int3"', r"weights must be auto or one of .*table 2"),
        ('model = "a"\ndtype = "fp16"', r"dtype must be .*table 2"),
        ('model = "a"\nmemory_budget_gb = -1', r"memory_budget_gb must be .*table 2"),
        ('model = "a"\nmemory_budget_gb = "4"', r"memory_budget_gb: expected float.*table 2"),
        ('model = "a"\nlayers = 4', r"layers: expected str.*table 2"),
        ("model = 1", r"model: expected str.*table 2"),
        ('model = ""', r"model must be a non-empty .*table 2"),
        ('layers = "0:4"', r"\[\[serve\]\] table 2 .* has no model"),
    ],
)
def test_bad_serve_table(tmp_path: Path, table: str, match: str) -> None:
    path = write(tmp_path, f'[[serve]]\nmodel = "ok"\n\n[[serve]]\n{table}\n')
    with pytest.raises(ConfigError, match=match) as info:
        load_config({}, path, {})
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text", ['serve = "a"\n', "serve = [1]\n", '[serve]\nmodel = "a"\n'])
def test_serve_that_is_not_a_list_of_tables(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match=r"serve: expected \[\[serve\]\] tables"):
        load_config({}, write(tmp_path, text), {})


def test_serve_flag_values_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"layers must be .*flag --layers"):
        load_config({"serve": (ServeSpec("a"), ServeSpec("b", layers="7"))}, None, {})
    with pytest.raises(ConfigError, match=r"model must be .*flag --model"):
        load_config({"serve": (ServeSpec(""), ServeSpec("b"))}, None, {})
    with pytest.raises(ConfigError, match="expected a tuple of ServeSpec"):
        load_config({"serve": ("a", "b")}, None, {})


def test_a_model_served_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'a' is named twice .*flag --model"):
        load_config({"serve": (ServeSpec("a"), ServeSpec("a", layers="0:4"))}, None, {})
    path = write(
        tmp_path, '[[serve]]\nmodel = "a"\n[[serve]]\nmodel = "b"\n[[serve]]\nmodel = "a"\n'
    )
    with pytest.raises(ConfigError, match="'a' is named twice") as info:
        load_config({}, path, {})
    assert str(path) in str(info.value)


def test_no_model_from_each_layer(tmp_path: Path) -> None:
    assert load_config({"no_model": True}, None, {}).no_model
    assert load_config({}, None, {"SWARMD_NO_MODEL": "1"}).served() == ()
    assert not load_config({}, None, {"SWARMD_NO_MODEL": "off"}).no_model
    assert load_config({}, write(tmp_path, "no_model = true\n"), {}).no_model
    assert not load_config({"no_model": False}, None, {"SWARMD_NO_MODEL": "yes"}).no_model
    with pytest.raises(ConfigError, match="SWARMD_NO_MODEL"):
        load_config({}, None, {"SWARMD_NO_MODEL": "maybe"})


@pytest.mark.parametrize(
    ("flags", "env", "text", "match"),
    [
        ({"model": "m"}, {}, "", r"but model is set too \(from flag --model\)"),
        ({}, {"SWARMD_MODEL": "m"}, "", r"model is set too \(from env SWARMD_MODEL\)"),
        ({}, {}, 'model = "m"\n', "model is set too .*config file"),
        ({"layers": "0:4"}, {}, "", r"layers is set too \(from flag --layers\)"),
        ({}, {"SWARMD_LAYERS": ""}, "", "layers is set too .*SWARMD_LAYERS"),
        ({"serve": (ServeSpec("a"),)}, {}, "", r"models to serve is set too \(from flag"),
        ({}, {}, '[[serve]]\nmodel = "a"\n', "models to serve is set too .*config file"),
    ],
)
def test_no_model_refuses_a_model(
    tmp_path: Path, flags: dict[str, object], env: dict[str, str], text: str, match: str
) -> None:
    path = write(tmp_path, "no_model = true\n" + text)
    with pytest.raises(ConfigError, match=r"no_model .*holds no model") as info:
        load_config(flags, path, env)
    assert re.search(match, str(info.value))


def test_no_model_with_default_model_fields_is_fine() -> None:
    config = load_config({"no_model": True, "weights": "int8", "serve": ()}, None, {})
    assert config.no_model
    assert config.model == Config.model


def test_serve_env_var_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"SWARMD_SERVE .*config file.*--model"):
        load_config({}, None, {"SWARMD_SERVE": "a,b"})
    with pytest.raises(ConfigError, match="SWARMD_SERVE"):
        load_config({"serve": (ServeSpec("a"),)}, None, {"SWARMD_SERVE": "a"})


def test_flat_fields_still_work_with_no_serve(tmp_path: Path) -> None:
    path = write(tmp_path, 'model = "from-file"\nlayers = "0:4"\n')
    config = load_config({}, path, {})
    assert config.serve == ()
    assert config.served() == (ServeSpec("from-file", "0:4"),)
