"""What a new user meets first: the README, the pages of ``docs/`` and ``examples/``.

- The README's environment-variable table is generated from the settings module.
- Every fenced ``python`` block of the README and of the ``docs/`` pages in ``PAGES`` runs, in a
  fresh namespace, and every ``bash`` block in ``bash -e``, unless ``SKIP`` names it (by its first
  line, spaces collapsed; by ``"section :: first line"`` where several blocks start alike, the
  section being the ``## `` heading it is under, on whichever page) with the reason. A new block
  is run by default; one that fails turns the suite red. A fragment that assumes names defined
  elsewhere (``model``, ``x``, ``loader``) gets them from ``SETUP``, run first in the same
  namespace; the block itself runs as written. ``CHECK`` adds assertions after a few blocks.
  Blocks run in this process (tracebacks give the page's line numbers, ``page:line``) with its
  process-wide settings restored afterwards, except those in ``OWN_PROCESS``, whose effect
  cannot be undone.
- Every relative link of the README and of ``docs/*.md`` leads to a file of the repository, and
  a link's ``#anchor`` to a heading of the page it names.
- Every ``examples/*.py`` runs as ``python examples/X.py`` (with arguments that shorten it), and
  one that needs an extra says which to install, rather than ending in an ImportError traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from torchtpu.config import env_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
# The pages whose code blocks run, README first. The docs pages made from README sections keep
# their "## " headings, so SKIP, SETUP and CHECK name their blocks as they did in the README.
PAGES = [
    "README.md",
    "docs/compatibility.md",
    "docs/training.md",
    "docs/attention.md",
    "docs/kernels.md",
    "docs/distributed.md",
    "docs/torch_tpu.md",
    "docs/transformers.md",
    "docs/diffusers.md",
    "docs/litert.md",
    "docs/ray.md",
    "docs/torchtitan.md",
    "docs/sglang.md",
    "docs/vllm.md",
    "docs/diagnostics.md",
]

PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}


def test_readme_env_table_matches_settings():
    assert env_table() in README.read_text(), "regenerate the README table with `torchtpu info --env`"


# ---------------------------------------------------------------- the code blocks of the README and docs pages

@dataclass(frozen=True)
class Block:
    lang: str      # "python" or "bash"
    page: str      # the page it is on, relative to the repository root ("README.md", "docs/x.md")
    line: int      # the page's line of its first code line (1-based)
    section: str   # the "## " heading it is under
    source: str

    @property
    def where(self) -> str:
        """``page:line``, as a failure names it."""
        return f"{self.page}:{self.line}"

    @property
    def first_line(self) -> str:
        """Its first non-blank line, spaces collapsed."""
        return next((" ".join(line.split()) for line in self.source.splitlines() if line.strip()), "")

    def named(self, name: str) -> bool:
        """Whether a SKIP, SETUP, CHECK or OWN_PROCESS entry names it: by its first line, or by
        ``"section :: first line"`` where several blocks start alike (``import torch``)."""
        return name in (self.first_line, f"{self.section} :: {self.first_line}")


def page_blocks(page: str, text: str) -> list[Block]:
    """A page's fenced python and shell blocks (a fence without a language is not code)."""
    blocks, section, fence = [], "", None
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif line.startswith("```"):
                fence = (line[3:].strip().lower(), number + 1, [])
        elif line.startswith("```"):
            lang, start, body = fence
            fence = None
            if lang in PYTHON or lang in SHELL:
                blocks.append(Block("python" if lang in PYTHON else "bash", page, start, section,
                                    "\n".join(body) + "\n"))
        else:
            fence[2].append(line)
    assert fence is None, f"{page}: the code fence opened at line {fence[1] - 1} is never closed"
    return blocks


BLOCKS = [block for page in PAGES for block in page_blocks(page, (ROOT / page).read_text())]

# Blocks that do not run here, by first line, with the reason. Each must name a block of PAGES.
SKIP = {
    "pip install -e . && torchtpu demo # install, then run the main job":
        "installs the package (the tests run in the installed checkout); `torchtpu demo` takes minutes",
    "import os, torch":  # Hugging Face
        "needs the hf extra and a checkpoint `path`, `ids`, a tokenizer and a data set; tests/test_hf.py "
        "checks each of its lines against CPU",
    "pipe = DiTPipeline.from_pretrained(path).to(\"tpu\") # or DDPMPipeline, ...":
        "needs the diffusers extra and a checkpoint `path`; tests/test_diffusers.py runs the DiT pipeline",
    "import litert_torch":
        "needs the litert extra (litert-torch, ai-edge-litert); tests/test_litert.py converts and runs a model",
    "from transformers import AutoModelForSequenceClassification":
        "needs the hf and litert extras and a checkpoint `path`",
    "tools/vllm_env.sh && source /tmp/vllmenv/bin/activate":
        "builds a venv with vLLM and starts a server; tests/test_vllm.py (skipped without vLLM)",
    "source /tmp/titanenv/bin/activate":
        "needs the venv tools/torchtitan_env.sh builds; tests/test_torchtitan.py (slow) runs these commands",
    "# expert parallel over 2 processes: each holds half the experts; TorchTitan's":
        "needs the venv tools/torchtitan_env.sh builds and minutes a step; tests/test_torchtitan_moe.py (slow) "
        "runs it",
    "/tmp/titanenv/bin/python tools/pod_plan.py # Qwen3-8B, TPU7x, 256-8,192 chips, FSDP and FSDP x TP 4":
        "needs the venv tools/torchtitan_env.sh builds and minutes per layout; "
        "tests/test_torchtitan_compile.py checks the plan's inputs (the chip table, TorchTitan's peak)",
    "tools/sglang_env.sh && source /tmp/sglangenv/bin/activate":
        "builds a venv with SGLang and starts a server; tests/test_sglang.py (skipped without SGLang)",
}

# The names a fragment assumes, defined before it runs (in the same namespace).
_MODEL = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to("tpu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(8, 16, device="tpu"), torch.randint(0, 4, (8,), device="tpu")
"""
SETUP = {
    "Quick start :: import torch": """
import torch
class MyModel(torch.nn.Linear):
    def __init__(self):
        super().__init__(4, 2)
def train_step(x):
    return (x * 2).sum()
""",
    "torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE # property: the process default":
        "import torch",
    "model = GPT(config).to(\"tpu\")": """
import torch
import torch.nn.functional as F
config = 64  # the vocabulary
def GPT(vocab):
    return torch.nn.Sequential(torch.nn.Embedding(vocab, 32), torch.nn.Linear(32, vocab))
x, y = torch.randint(0, 64, (2, 8), device="tpu"), torch.randint(0, 64, (2, 8), device="tpu")
""",
    "g = torch.tpu.TPUGraph()": """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 64), torch.nn.ReLU()).to("tpu")
loader = [torch.randn(64, 512) for _ in range(2)]
""",
    "@torch.tpu.compile_step": _MODEL + """
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
loader = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(3)]  # warm-up, capture, replay
""",
    "with torch.autocast(\"tpu\"): # bfloat16 by default on tpu; dtype=torch.float16 too": _MODEL,
    "from torch.nn.attention.flex_attention import create_block_mask, flex_attention": """
import torch
B, H, L, E = 1, 2, 128, 16
q, k, v = (torch.randn(B, H, L, E, device="tpu") for _ in range(3))
""",
    "@torchtpu.jax_op(\"mylib::rms_norm\") # or torch.tpu.jax_op; no name: from module/qualname": """
import jax
import torch
import torchtpu
x, w = torch.randn(4, 8, device="tpu"), torch.rand(8, device="tpu")
""",
    "# torchrun --standalone --nproc-per-node 4 train.py": """
import os, socket
import torch
with socket.socket() as s:  # what torchrun would set, for a world of one process
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))
class Transformer(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(cfg, cfg) for _ in range(2))
    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return x
cfg = 8
""",
}

# Assertions after a block, in its namespace.
CHECK = {
    "import torch # torchtpu loads itself (torch.backends entry point)": """
assert x.device.type == "tpu" and type(x) is torch.Tensor and torch.isfinite(loss).item()
""",
    "Quick start :: import torch": """
assert b.tolist() == [[1.0, 3.0], [2.0, 4.0], [3.0, 5.0]] and model.weight.device.type == "tpu"
assert step(torch.ones(3, device="tpu")).item() == 6.0
""",
    "g = torch.tpu.TPUGraph()": """
torch.testing.assert_close(static_y.cpu(), model(loader[-1].to("tpu")).cpu())
""",
    "@torch.tpu.compile_step": """
assert torch.isfinite(loss).item() and not step.recaptures
""",
    "from torch.nn.attention.flex_attention import create_block_mask, flex_attention": """
torch.testing.assert_close(out.cpu(), flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask).cpu())
""",
    "@torchtpu.jax_op(\"mylib::rms_norm\") # or torch.tpu.jax_op; no name: from module/qualname": """
expected = x.cpu() * torch.rsqrt((x.cpu() ** 2).mean(-1, keepdim=True) + 1e-6) * w.cpu()
torch.testing.assert_close(y.cpu(), expected)
torch.testing.assert_close(torch.ops.mylib.rms_norm(x, w).cpu(), expected)
""",
    "# torchrun --standalone --nproc-per-node 4 train.py": """
import torch.distributed as dist
model(torch.randn(4, cfg, device="tpu")).sum().backward()
assert dist.get_backend() == "tpu" and all(p.grad is not None for p in model.parameters())
dist.destroy_process_group()
""",
}

# Blocks run in a process of their own: what they change cannot be undone in this one.
OWN_PROCESS = {
    "@torchtpu.jax_op(\"mylib::rms_norm\") # or torch.tpu.jax_op; no name: from module/qualname":
        "defines the op mylib::rms_norm, which a process can define once",
}


def _entry(table: dict[str, str], block: Block) -> str | None:
    return next((value for name, value in table.items() if block.named(name)), None)


def _names_problems() -> list[str]:
    """Entries of SKIP, SETUP, CHECK and OWN_PROCESS that do not name exactly one block of PAGES."""
    problems = []
    for table in ("SKIP", "SETUP", "CHECK", "OWN_PROCESS"):
        for name in globals()[table]:
            found = [b.where for b in BLOCKS if b.named(name)]
            if len(found) != 1:
                problems.append(f"{table}[{name!r}] names {len(found)} blocks {found}: give it the block's "
                                "first line (\"section :: first line\" where several start alike)")
    return problems


def test_pages_exist():
    """Every page of PAGES is there (a page renamed or removed must leave the list, not its blocks unrun)."""
    missing = [page for page in PAGES if not (ROOT / page).is_file()]
    assert not missing and len(set(PAGES)) == len(PAGES), missing


def test_readme_block_names_are_current():
    """Every entry of SKIP, SETUP, CHECK and OWN_PROCESS names one block of the README or a page of
    PAGES: an edited block's entries must follow it, and a removed block's go."""
    assert not _names_problems(), "\n".join(_names_problems())
    skipped = [b for b in BLOCKS if _entry(SKIP, b) is not None]
    assert not [b for b in skipped if _entry(SETUP, b) or _entry(CHECK, b) or _entry(OWN_PROCESS, b)], \
        "a skipped block has set-up or checks"


def _block_id(block: Block) -> str:
    same = [b for b in BLOCKS if b.page == block.page and b.section == block.section]
    suffix = f"-{same.index(block) + 1}" if len(same) > 1 else ""
    section = re.sub(r"[^A-Za-z0-9]+", "_", block.section).strip("_") or "intro"
    page = "" if block.page == "README.md" else f"{Path(block.page).stem}:"
    return f"{block.lang}:{page}{section}{suffix}"


def _script(block: Block) -> tuple[str, str]:
    """The set-up, and the block padded with blank lines so that its line numbers are its page's."""
    return _entry(SETUP, block) or "", "\n" * (block.line - 1) + block.source


@pytest.fixture
def process_settings():
    """Restore what a block may set for the whole process (eager mode, matmul precision,
    default dtype and device index, the environment and working directory, the default process
    group)."""
    import torch.distributed as dist

    saved = (torch.tpu.eager_mode, torch.get_float32_matmul_precision(), torch.get_default_dtype(),
             torch.tpu.current_device(), dict(os.environ), os.getcwd())
    yield
    torch.tpu.synchronize()
    torch.tpu.eager_mode, precision, dtype, device, environ, cwd = saved
    torch.set_float32_matmul_precision(precision)
    torch.set_default_dtype(dtype)
    torch.tpu.set_device(device)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_in_process(block: Block, tmp_path: Path) -> None:
    setup, code = _script(block)
    namespace = {"__name__": "__readme__"}
    os.chdir(tmp_path)  # a block that writes files writes them here
    failure = None
    try:
        exec(compile(setup, "<SETUP>", "exec"), namespace)
        exec(compile(code, str(ROOT / block.page), "exec"), namespace)
        exec(compile(_entry(CHECK, block) or "", "<CHECK>", "exec"), namespace)
    except Exception:  # the traceback from the block on (pytest's would print the page from its top)
        failure = traceback.format_exc()
    if failure:
        pytest.fail(f"{block.where} ({block.section}) failed:\n{failure}", pytrace=False)


def _run_in_subprocess(block: Block, tmp_path: Path) -> None:
    setup, code = _script(block)
    runner = textwrap.dedent(f"""
        import sys
        namespace = {{"__name__": "__readme__"}}
        for source, filename in zip(sys.argv[1:4], ("<SETUP>", {str(ROOT / block.page)!r}, "<CHECK>")):
            exec(compile(open(source).read(), filename, "exec"), namespace)
        """)
    paths = []
    for name, text in (("setup.py", setup), ("block.py", code), ("check.py", _entry(CHECK, block) or "")):
        (tmp_path / name).write_text(text)
        paths.append(str(tmp_path / name))
    proc = subprocess.run([sys.executable, "-c", runner, *paths], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{block.where} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.parametrize("block", BLOCKS, ids=[_block_id(b) for b in BLOCKS])
def test_readme_block_runs(block: Block, tmp_path, request):
    # a stale SKIP name must not let an install or a server run
    assert not _names_problems(), "see test_readme_block_names_are_current"
    if _entry(SKIP, block) is not None:
        pytest.skip(_entry(SKIP, block))
    if block.lang == "bash":
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.source], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, f"{block.where} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    elif _entry(OWN_PROCESS, block) is not None:
        _run_in_subprocess(block, tmp_path)
    else:
        request.getfixturevalue("process_settings")
        _run_in_process(block, tmp_path)


# ---------------------------------------------------------------- links

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\n[ \t]*\n).)+?\1", re.S)  # inline code, never across a blank line
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]*(?:\([^()\s]*\)[^()\s<>]*)*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def _blank(match: re.Match) -> str:
    """The match's text with every character but newlines blanked, so positions keep their lines."""
    return re.sub(r"[^\n]", " ", match.group(0))


def _prose(text: str) -> str:
    """The page without its code blocks and code spans (a link there is text, not a link)."""
    return _CODE_SPAN.sub(_blank, _FENCE.sub(_blank, text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (a link's text, not its target), lower case, without
    punctuation other than ``-`` and ``_``, spaces as ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors of a Markdown page: its headings' (``-1``, ``-2`` for repeats) and ``<a name>``s."""
    text = path.read_text()
    anchors, seen = set(), {}
    for heading in _HEADING.findall(_FENCE.sub(_blank, text)):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors | set(_HTML_ANCHOR.findall(text))


def _links(path: Path) -> list[tuple[int, str]]:
    """A page's link targets (inline and reference definitions), with their line numbers."""
    prose = _prose(path.read_text())
    found = [(m.start(1), m.group(1)) for pattern in (_LINK, _REFERENCE) for m in pattern.finditer(prose)]
    return sorted((prose.count("\n", 0, start) + 1, target) for start, target in found)


LINKED_PAGES = [README, *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("path", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    """Every relative link of the page names a file or folder of the repository, and its
    ``#anchor``, where it has one and names a Markdown page, a heading of that page."""
    broken = []
    for line, target in _links(path):
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http:, https:, mailto:: outside the repository
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(ROOT)}:{line}: {target}"
        if not resolved.exists():
            broken.append(f"{where} (no such file)")
        elif ROOT not in resolved.parents and resolved != ROOT:
            broken.append(f"{where} (outside the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


def test_link_check_finds_links():
    """The link check sees what it checks: the README links each page made from its sections, and
    a broken link, a link in code and a heading's anchor are told apart."""
    readme_targets = {target for _, target in _links(README)}
    moved = [page for page in PAGES[1:] if page not in readme_targets]
    assert not moved, f"README.md does not link {moved}"
    sample = "[a](x.md#one) `[b](code.md)`\n```\n[c](fenced.md)\n```\n[d]: y.md\n"
    assert [m.group(1) for m in _LINK.finditer(_prose(sample))] == ["x.md#one"]
    assert [m.group(1) for m in _REFERENCE.finditer(_prose(sample))] == ["y.md"]
    assert _slug("JAX and Pallas kernels as torch ops: `torchtpu.jax_op`") == \
        "jax-and-pallas-kernels-as-torch-ops-torchtpujax_op"
    assert _slug("Distributed: torchrun, DDP, FSDP2, tensor parallel") == "distributed-torchrun-ddp-fsdp2-tensor-parallel"


# ---------------------------------------------------------------- examples/*.py

# Arguments that shorten a run ({tmp}: the test's temporary directory); an example not listed
# runs with none.
ARGS = {
    "train_mlp.py": ["--steps", "30"],
    "train_gpt_compiled.py": ["--steps", "3"],
    "train_fsdp.py": ["--steps", "2", "--log-every", "1"],
    "hf_finetune.py": ["--steps", "2", "--out", "{tmp}"],
    "diffusers_pipeline.py": ["--steps", "2", "--size", "16", "--batch", "1"],
    "export_litert.py": ["--steps", "3", "--out", "{tmp}/net.tflite"],
}
# The extra an example needs, and the modules of it that the example imports, first import first.
EXTRAS = {
    "hf_finetune.py": ("hf", ["accelerate", "tokenizers", "transformers"]),
    "diffusers_pipeline.py": ("diffusers", ["diffusers"]),
    "export_litert.py": ("litert", ["litert_torch", "ai_edge_litert"]),
    "ray_workflow.py": ("ray", ["ray"]),
}
# Examples run elsewhere, with the reason.
RUN_ELSEWHERE = {
    "ray_workflow.py": "tests/test_ray.py runs it (it starts a Ray cluster; skipped without the ray extra)",
}
# Runs over ~30 s on 2 cores.
SLOW = {"hf_finetune.py"}  # its compiled generate; tests/test_hf.py checks the same calls

EXAMPLE_FILES = sorted(path.name for path in EXAMPLES.glob("*.py"))


def _new_user_env() -> dict[str, str]:
    """This environment, without the test session's forced XLA:CPU device count: a new user's
    machine has one XLA:CPU device."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else [])
                                  for n in EXAMPLE_FILES])
def test_example_runs(name: str, tmp_path):
    if name in RUN_ELSEWHERE:
        pytest.skip(RUN_ELSEWHERE[name])
    extra, modules = EXTRAS.get(name, (None, []))
    missing = [m for m in modules if not _installed(m)]
    if missing:
        pytest.skip(f"needs the {extra} extra ({', '.join(missing)} not installed); "
                    "test_example_without_its_extra_says_which checks what it says")
    args = [a.format(tmp=tmp_path) for a in ARGS.get(name, [])]
    proc = subprocess.run([sys.executable, f"examples/{name}", *args], cwd=ROOT, env=_new_user_env(),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"python examples/{name} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-6000:]}"


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_example_without_its_extra_says_which(name: str, monkeypatch):
    """``python examples/X.py`` where the extra's first module is not installed (hidden here,
    whether or not it is) ends with a message naming the extra, not an ImportError traceback.
    The example's imports run in this process: up to the missing module, they are torch's and
    the standard library's, and its module-level statements (environment defaults) are undone."""
    import runpy

    extra, modules = EXTRAS[name]
    monkeypatch.setitem(sys.modules, modules[0], None)  # `import` of it raises ImportError
    monkeypatch.setattr(sys, "argv", [f"examples/{name}"])
    environ = dict(os.environ)
    try:
        with pytest.raises(SystemExit) as exit:
            runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    finally:
        os.environ.clear()
        os.environ.update(environ)
    # what Python prints for it, with exit status 1
    assert isinstance(exit.value.code, str) and f"pip install 'torchtpu[{extra}]'" in exit.value.code, exit.value.code


def test_examples_have_their_extras_listed():
    """An example that imports a module of an extra is listed in EXTRAS (so that it is checked to
    name the extra when the module is missing)."""
    extras_modules = {"transformers": "hf", "diffusers": "diffusers", "litert_torch": "litert", "ray": "ray",
                      "ai_edge_litert": "litert", "accelerate": "hf"}
    for name in EXAMPLE_FILES:
        imported = set(re.findall(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", (EXAMPLES / name).read_text(), re.M))
        needs = {extras_modules[m] for m in imported if m in extras_modules}
        assert needs <= {EXTRAS.get(name, (None,))[0]}, f"examples/{name} imports modules of {needs}: add it to EXTRAS"
    assert set(EXTRAS) | set(ARGS) | set(RUN_ELSEWHERE) | SLOW <= set(EXAMPLE_FILES), "an entry names no example"
