"""freeze_startup_heap: live objects leave the collector's generations; later garbage, cycles
included, is still collected. imports_unscanned: a command's imports run with the collector
off, and a process's own command freezes them."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref

from dsmesh.runtime.heap import freeze_startup_heap, imports_unscanned


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_start_up_objects_are_frozen_and_later_cycles_still_collected() -> None:
    try:
        kept = [_Node() for _ in range(1000)]
        frozen = freeze_startup_heap()
        assert frozen >= len(kept) and gc.get_freeze_count() == frozen
        # the collector's generations now hold only what was made after the freeze
        assert not any(obj is kept for obj in gc.get_objects())
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle made after start-up
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None  # reference counting alone cannot free a cycle
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


def test_imports_unscanned_pauses_the_collector_then_freezes_what_was_made() -> None:
    try:
        assert gc.isenabled()
        with imports_unscanned(freeze=True):
            assert not gc.isenabled()
            made = [_Node() for _ in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(made)
        assert not any(obj is made for obj in gc.get_objects())  # out of every generation
    finally:
        gc.unfreeze()


def test_imports_unscanned_without_freeze_leaves_objects_collectable() -> None:
    frozen = gc.get_freeze_count()
    with imports_unscanned(freeze=False):
        a, b = _Node(), _Node()
        a.other, b.other = b, a
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None


def test_imports_unscanned_keeps_a_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        with imports_unscanned(freeze=False):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_only_a_process_command_freezes_its_imports() -> None:
    """``dsmesh`` as the process's command (``main()`` reads ``sys.argv``) runs with its
    imports frozen; ``main(argv)`` called in-process (a test) freezes nothing."""
    code = """
        import gc, sys
        from dsmesh.cli import main as cli

        def report(args):  # runs after the command's module is imported, before the command
            print(gc.get_freeze_count() > 0, gc.isenabled())
            raise SystemExit(0)

        cli.apply_process_flags = report
        how = sys.argv.pop(1)
        sys.argv = ["dsmesh", "kv-broker"]
        cli.main() if how == "process" else cli.main(["kv-broker"])
    """
    for how, frozen in (("process", True), ("in-process", False)):
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), how],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == [str(frozen), "True"], how
