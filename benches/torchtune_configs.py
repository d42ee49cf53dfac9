#!/usr/bin/env python3
"""Runs `tune validate` on torchtune's multi-device configs, as a new user would.

A config is multi-device when its recipe is a `*_distributed` one: in torchtune's
`torchtune/_recipe_registry.py`, or in the header comment the config starts with
("... in full_finetune_distributed.py", "tune run ... lora_finetune_distributed ...").
Each config is validated verbatim, recipe inferred from its header as `tune validate FILE`
does (`--recipe` from the registry only when the header names none), with the paths it
reads pointed at dummy files: what the config names, re-rooted under a scratch directory,
stands in for the `tune download` its header asks for. Nothing else is overridden.

Usage (torchtune fetched as a bare git directory, or a checkout):

    python3 benches/torchtune_configs.py --torchtune /path/to/torchtune[.git] \
        --tune target/debug/tune [--rev HEAD] [--only-failures]

Prints one line per config (OK, or FAIL with tune's error) and the counts. Needs PyYAML.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import yaml

# The tokenizer keys that name files (torchtune's tokenizer builders' arguments).
TOKENIZER_FILES = (
    "path",
    "vocab_path",
    "merges_path",
    "merges_file",
    "tokenizer_json_path",
    "special_tokens_path",
    "tokenizer_config_json_path",
    "generation_config_path",
)


DATA_EXTENSIONS = (".json", ".jsonl", ".csv", ".parquet", ".txt", ".arrow")


def git(repo, *args):
    """`git` on `repo`, a bare git directory or a checkout."""
    where = ["--git-dir", repo] if not os.path.isdir(os.path.join(repo, ".git")) else ["-C", repo]
    return subprocess.run(["git", *where, *args], check=True, capture_output=True, text=True).stdout


def registry(repo, rev):
    """{config file under recipes/configs: [recipe names]} from torchtune's recipe registry."""
    source = git(repo, "show", f"{rev}:torchtune/_recipe_registry.py")
    scope = {}
    exec(compile(source, "_recipe_registry.py", "exec"), scope)  # dataclasses only
    out = {}
    for recipe in scope["_ALL_RECIPES"]:
        for config in recipe.configs:
            out.setdefault(config.file_path, []).append(recipe.name)
    return out


def header_recipes(text):
    """The `*_distributed` recipe names the config's leading comment mentions."""
    names = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            break
        names += re.findall(r"[A-Za-z0-9_/]+_distributed\b", line)
    return names


def resolve(value, root):
    """OmegaConf's `${a.b}` in a string, against the config's top level (enough for paths)."""
    for _ in range(10):
        if not isinstance(value, str) or "${" not in value:
            return value
        def lookup(m):
            node = root
            for part in m.group(1).split("."):
                node = node.get(part) if isinstance(node, dict) else None
            return "" if node is None else str(node)
        value = re.sub(r"\$\{([^}]+)\}", lookup, value)
    return value


def touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path):
        open(path, "w").close()


def dummy_paths(cfg, scratch):
    """The overrides that point every path `cfg` reads at a dummy under `scratch`."""
    overrides = []

    def rerooted(path):
        path = os.path.normpath(path)
        return os.path.join(scratch, path.lstrip("/").lstrip("./"))

    for key, section in cfg.items():
        if not isinstance(section, dict):
            continue
        if "checkpoint_dir" in section:
            directory = rerooted(resolve(section["checkpoint_dir"], cfg))
            os.makedirs(directory, exist_ok=True)
            files = section.get("checkpoint_files")
            if isinstance(files, list):
                names = [resolve(f, cfg) for f in files]
            elif isinstance(files, dict) and "filename_format" in files:
                last = int(str(files["max_filename"]))
                width = len(str(files["max_filename"]))
                names = [
                    files["filename_format"].format(str(i).zfill(width), str(last).zfill(width))
                    for i in range(1, last + 1)
                ]
            else:
                names = []
            for name in names + [section.get("adapter_checkpoint")]:
                if name:
                    touch(os.path.join(directory, resolve(name, cfg)))
            # A directory given as a variable (`checkpoint_dir: ${base_model_path}`, torchtune's
            # GRPO configs) is changed where a user changes it: the variable.
            variable = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", str(section["checkpoint_dir"]))
            if variable and variable.group(1) in cfg:
                change = f"{variable.group(1)}={directory}"
            else:
                change = f"{key}.checkpoint_dir={directory}"
            if change not in overrides:
                overrides.append(change)
        if key.startswith("tokenizer"):
            for name in TOKENIZER_FILES:
                value = resolve(section.get(name), cfg)
                if not isinstance(value, str):
                    continue
                path = rerooted(value)
                touch(path)
                # tune reads the tokenizer.json `tune download` puts beside or above
                # `original/tokenizer.model`.
                if name in ("path", "vocab_path"):
                    parent = os.path.dirname(path)
                    if os.path.basename(parent) == "original":
                        parent = os.path.dirname(parent)
                    touch(os.path.join(parent, "tokenizer.json"))
                overrides.append(f"{key}.{name}={path}")
        for name in ("data_files",):
            value = section.get(name)
            # tune's `paths::looks_local`: a file path, not a Hub dataset or a URL.
            local = (
                isinstance(value, str)
                and "://" not in value
                and (value.startswith(("/", ".", "~")) or value.endswith(DATA_EXTENSIONS))
            )
            if key.startswith("dataset") and local:
                path = rerooted(resolve(value, cfg))
                touch(path)
                overrides.append(f"{key}.{name}={path}")
    return overrides


def tune_recipes(tune):
    """The recipe names `tune ls` lists (its first column)."""
    listing = subprocess.run([tune, "ls"], check=True, capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines()[1:] if line[:1].strip()}


def validate(tune, file, overrides, recipe=None):
    cmd = [tune, "validate", file, *overrides] + (["--recipe", recipe] if recipe else [])
    run = subprocess.run(cmd, capture_output=True, text=True)
    return run.returncode, (run.stdout + run.stderr).strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torchtune", required=True, help="torchtune's git directory or checkout")
    ap.add_argument("--tune", required=True, help="the tune binary")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--only-failures", action="store_true")
    args = ap.parse_args()
    tune = os.path.abspath(args.tune)

    reg = registry(args.torchtune, args.rev)
    files = [
        f[len("recipes/configs/"):]
        for f in git(args.torchtune, "ls-tree", "-r", "--name-only", args.rev, "recipes/configs").split()
        if f.endswith(".yaml")
    ]
    has = tune_recipes(tune)
    ok, failed, lacking = [], [], []
    with tempfile.TemporaryDirectory(prefix="tune-torchtune-configs-") as tmp:
        for rel in sorted(files):
            text = git(args.torchtune, "show", f"{args.rev}:recipes/configs/{rel}")
            by_registry = [r for r in reg.get(rel, []) if r.endswith("_distributed")]
            if not by_registry and not header_recipes(text):
                continue
            path = os.path.join(tmp, "configs", rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            recipe = (by_registry or header_recipes(text))[0].split("/")[-1]
            if recipe not in has:
                lacking.append(rel)
            cfg = yaml.safe_load(text) or {}
            scratch = os.path.join(tmp, "models", rel)
            overrides = dummy_paths(cfg, scratch)
            rc, out = validate(tune, path, overrides)
            if rc != 0 and "cannot tell which recipe" in out and by_registry:
                rc, out = validate(tune, path, overrides, by_registry[0].split("/")[-1])
            out = out.replace(tmp + "/configs/", "").replace(scratch, "<model>")
            if rc == 0:
                ok.append(rel)
                # "Config is well-formed for <script>!": the recipe tune inferred, which the
                # registry may name differently (a header that names another recipe).
                found = re.search(r"well-formed for (\S+)!", out)
                script = found.group(1) if found else "?"
                expected = [r.split("/")[-1] for r in by_registry]
                differs = f"  (registry: {', '.join(expected)})" if expected and script not in expected else ""
                if not args.only_failures or differs:
                    print(f"OK    {rel}  [{script}]{differs}")
            else:
                failed.append((rel, out))
                print(f"FAIL  {rel}" + (f"  (tune has no {recipe})" if rel in lacking else ""))
                for line in out.splitlines():
                    print(f"        {line}")
    total = len(ok) + len(failed)
    print(f"\n{len(ok)} of {total} multi-device configs validate; {len(failed)} do not")
    ours = [rel for rel in ok + [f for f, _ in failed] if rel not in lacking]
    print(
        f"{len([r for r in ok if r not in lacking])} of the {len(ours)} for recipes tune has "
        f"validate; {len(lacking)} are for recipes tune does not have"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
