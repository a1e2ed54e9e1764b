"""Orbax checkpoints that survive preemption, kill -9 and torn files.

A thin layer over `orbax.checkpoint.CheckpointManager`: Orbax does the async
writes, the atomic commit (a step is written to `<step>.orbax-checkpoint-tmp` and
renamed to `<step>` only when complete), the retention policies and the
multi-host coordination. This module adds the resume rules a trainer needs:

  DIR/<step>/state/    the pytree: params, optimizer state, step, PRNG keys (OCDBT)
  DIR/<step>/extras/   JSON: policy version, scheduler and data-iterator state, config
  DIR/<step>.orbax-checkpoint-tmp   a save in progress or killed; never restored,
                       removed when the next manager opens DIR
  DIR/<step>.unreadable   a step that failed to restore while an older one worked;
                       kept for inspection, invisible to Orbax

Typed PRNG keys (`jax.random.key`, any impl) are saved and restored as they are;
put them in `state`. Raw uint32 keys (`jax.random.PRNGKey`) work too. To move a
key through JSON instead, use `jax.random.key_data` / `jax.random.wrap_key_data`.

Typical loop::

  with PreemptionFlag() as preempted, CheckpointManager(workdir) as ckpt:
    restored = ckpt.restore(abstract_state)  # jax.eval_shape + shardings
    state, extras, start = restored if restored else (init(), {}, 0)
    for step in range(start + 1, total_steps + 1):
      state = train_step(state, batch)
      stop = preempted.reached(step)
      if stop or ckpt.should_save(step):
        ckpt.save(step, state, {"policy_version": step, ...}, force=stop)
      if stop:
        break
  # leaving the `with` waits for the async save
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Self

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from posttrain import distributed

log = logging.getLogger(__name__)

_STATE, _EXTRAS = "state", "extras"
_UNREADABLE_SUFFIX = ".unreadable"
# Orbax's messages for a restore target that does not fit the checkpoint: the
# caller's abstract state is wrong, the files are fine, so no fallback.
_MISMATCH_MARKERS = (
    "tree structures do not match",
    "Structure mismatch",
    "is not compatible with the stored shape",
)


class _MismatchError(ValueError):
  """abstract_state does not fit a checkpoint (never a reason to fall back)."""


class CheckpointManager:
  """Saves and restores `(state, extras)` under one directory, one step per folder.

  Args:
    directory: local path or any URL Orbax accepts (gs://...); created if missing.
    save_every: `should_save(step)` is true when `step % save_every == 0` (and at
      a multi-host preemption sync point).
    keep_last: keep the newest `keep_last` checkpoints; None keeps all.
    keep_every: also keep, forever, every checkpoint whose step is a multiple of
      `keep_every` (must be a multiple of `save_every`).
    keep_steps: also keep, forever, the checkpoints of these steps (e.g. the one a KL
      reference is rebuilt from on resume).
    async_save: write in a background thread; `save` returns after the device
      to host copy, so the caller may donate or overwrite `state` right away.
    read_only: for readers of a live run (evaluation): never writes, and leaves
      the writer's in-progress tmp folders alone. One writer per directory.
  """

  def __init__(
      self,
      directory: str | os.PathLike[str],
      *,
      save_every: int = 100,
      keep_last: int | None = 3,
      keep_every: int | None = None,
      keep_steps: Sequence[int] = (),
      async_save: bool = True,
      read_only: bool = False,
  ):
    _check_positive("save_every", save_every)
    if keep_last is not None:
      _check_positive("keep_last", keep_last)
    if keep_every is not None:
      _check_positive("keep_every", keep_every)
      if keep_every % save_every:
        raise ValueError(
            f"keep_every={keep_every} must be a multiple of save_every={save_every}, "
            "or no periodic checkpoint would ever land on it"
        )
    directory = os.fspath(directory)
    self.directory = epath.Path(directory if "://" in directory else os.path.abspath(directory))
    preserve: list[Any] = [ocp.checkpoint_managers.LatestN(keep_last)]
    if keep_every is not None:
      preserve.append(ocp.checkpoint_managers.EveryNSteps(keep_every))
    if keep_steps:
      preserve.append(ocp.checkpoint_managers.CustomSteps([int(s) for s in keep_steps]))
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={
            _STATE: ocp.StandardCheckpointHandler(),
            _EXTRAS: ocp.JsonCheckpointHandler(),
        },
        options=ocp.CheckpointManagerOptions(
            save_decision_policy=ocp.checkpoint_managers.AnySavePolicy([
                ocp.checkpoint_managers.FixedIntervalPolicy(save_every),
                ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
            ]),
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(preserve),
            enable_async_checkpointing=async_save,
            # Leftovers of a killed save would otherwise pile up forever.
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        ),
    )
    self._pending_step: int | None = None
    self._read_only = read_only

  def should_save(self, step: int) -> bool:
    """True on the save cadence or a multi-host preemption sync point.

    Call it every step on every process: JAX's preemption sync needs that.
    """
    return self._manager.should_save(step)

  def save(self, step: int, state: Any, extras: Mapping[str, Any], *, force: bool = False) -> bool:
    """Starts saving `state` (a pytree of arrays) and `extras` (JSON-safe) as `step`.

    Args:
      step: the training step the state belongs to.
      state: any pytree of jax/numpy arrays, typed PRNG keys included.
      extras: a dict of JSON values; tuples come back as lists.
      force: save even off the cadence (preemption, end of training).

    Returns:
      True if a save was started; False if the cadence says no or `step` is
      already saved (a forced final save right after a periodic one).
    """
    step = _check_step(step)
    if self._read_only:
      raise ValueError(f"cannot save step {step}: {self.directory} was opened read_only")
    if not isinstance(extras, Mapping):
      raise TypeError(f"extras must be a dict of JSON values, got {type(extras).__name__}")
    _check_json_safe(extras, "extras")
    if step in self._manager.all_steps():
      log.info("checkpoint step %d already in %s; not saving again", step, self.directory)
      return False
    started = self._manager.save(
        step,
        args=ocp.args.Composite(
            **{_STATE: ocp.args.StandardSave(state), _EXTRAS: ocp.args.JsonSave(dict(extras))}
        ),
        force=force,
    )
    if started:
      self._pending_step = step
    return started

  def all_steps(self) -> list[int]:
    """Complete checkpoint steps in this directory, oldest first."""
    return sorted(s for s in self._manager.all_steps() if self._is_complete(s))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint step; None if there is none.

    A save still being written (here, or killed in another process) does not
    count. A committed step whose files were damaged later is only found out by
    `restore`, which then falls back past it.
    """
    return max(self.all_steps(), default=None)

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int] | None:
    """Restores `(state, extras, step)`, newest readable checkpoint first.

    Args:
      abstract_state: the state's pytree of `jax.ShapeDtypeStruct` with the
        target `.sharding` (any mesh; not necessarily the one used to save).
      step: restore exactly this step, with no fallback.

    Returns:
      `(state, extras, step)`, or None if the directory holds no complete checkpoint.

    Raises:
      ValueError: `abstract_state` does not match the saved tree or shapes, or
        `step` is not saved here.
      RuntimeError: checkpoints exist but none can be read.
    """
    _check_abstract_state(abstract_state)
    self.wait()
    available = self.all_steps()
    if step is not None:
      step = _check_step(step)
      if step not in available:
        raise ValueError(f"step={step} is not a complete checkpoint in {self.directory}; have {available}")
      return self._restore_step(abstract_state, step)

    unreadable: list[tuple[int, str]] = []
    for candidate in reversed(available):
      restored, reason = None, None
      try:
        restored = self._restore_step(abstract_state, candidate)
      except _MismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-except  # tensorstore/json/io errors
        reason = _one_line(e)
      # On many hosts the files of one step may be broken for some processes only.
      if _all_processes_agree(reason is None):
        self._set_aside(s for s, _ in unreadable)
        return restored
      reason = reason or "unreadable on another process"
      log.warning(
          "checkpoint step %d in %s is unreadable, falling back to an older one: %s",
          candidate, self.directory, reason,
      )
      unreadable.append((candidate, reason))
    if not unreadable:
      return None
    raise RuntimeError(
        f"no readable checkpoint in {self.directory}: "
        + "; ".join(f"step {s}: {reason}" for s, reason in unreadable)
    )

  def wait(self) -> None:
    """Blocks until pending async saves are on disk (re-raises their errors)."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases Orbax's threads."""
    self._manager.close()

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _is_complete(self, step: int) -> bool:
    # Orbax lists a step as soon as its save starts; only our own pending save
    # can be in that state (other processes' unfinished saves are tmp folders).
    if step != self._pending_step:
      return True
    if self._manager.is_saving_in_progress():
      return False
    path = self.directory / str(step)
    return path.exists() and ocp.step.is_path_finalized(path)

  def _restore_step(self, abstract_state: Any, step: int) -> tuple[Any, dict, int]:
    try:
      restored = self._manager.restore(
          step,
          args=ocp.args.Composite(
              **{_STATE: ocp.args.StandardRestore(abstract_state), _EXTRAS: ocp.args.JsonRestore()}
          ),
      )
    except Exception as e:  # pylint: disable=broad-except
      if any(marker in str(e) for marker in _MISMATCH_MARKERS):
        raise _MismatchError(
            f"abstract_state does not match checkpoint step {step} in {self.directory}: {_one_line(e)}"
        ) from e
      raise
    return restored[_STATE], restored[_EXTRAS], step

  def _set_aside(self, steps: Iterable[int]) -> None:
    """Renames unreadable steps so that new saves of those step numbers can land."""
    steps = list(steps)
    if not steps:
      return
    if self._read_only:
      return
    if jax.process_index() == 0:
      for step in steps:
        path = self.directory / str(step)
        target = self.directory / f"{step}{_UNREADABLE_SUFFIX}"
        n = 0
        while target.exists():  # the same step number went bad before
          n += 1
          target = self.directory / f"{step}{_UNREADABLE_SUFFIX}.{n}"
        path.rename(target)
        log.warning("moved unreadable checkpoint %s aside to %s", path, target)
    ocp.multihost.sync_global_processes("posttrain_checkpoint_set_aside")
    self._manager.reload()


class PreemptionFlag:
  """Turns SIGTERM / SIGINT into a flag the training loop polls.

  Single process: SIGTERM or SIGINT sets the flag; a SIGINT once the flag is up
  raises KeyboardInterrupt (Ctrl-C twice aborts without the final save).
  Several processes (`jax.distributed`): no handler is installed by default,
  since JAX's preemption service owns SIGTERM and all hosts must save at the same
  step; `reached(step)` asks JAX's preemption sync point instead.
  The previous handlers come back on `close()`.

  Args:
    signals: signals to catch; default SIGTERM and SIGINT on one process, none
      on several.
  """

  def __init__(self, signals: Iterable[int] | None = None):
    self._multiprocess = jax.process_count() > 1
    if signals is None:
      signals = () if self._multiprocess else (signal.SIGTERM, signal.SIGINT)
    self._event = threading.Event()
    self._uninstall = install_preemption_handler(self._on_signal, signals)

  def _on_signal(self, signum: int) -> None:
    if signum == signal.SIGINT and self._event.is_set():
      raise KeyboardInterrupt
    log.warning("received %s: will save a checkpoint and stop", signal.Signals(signum).name)
    self._event.set()

  def is_set(self) -> bool:
    """True once a signal arrived (or `set()` was called) on this process."""
    return self._event.is_set()

  def set(self) -> None:
    self._event.set()

  def reached(self, step: int) -> bool:
    """True when every process should save at `step` and stop.

    Call it every step on every process.
    """
    if not self._multiprocess:
      return self.is_set()
    try:
      return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # preemption service disabled
      return False

  def close(self) -> None:
    """Restores the signal handlers that were there before."""
    self._uninstall()

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def install_preemption_handler(
    callback: Callable[[int], None],
    signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT),
) -> Callable[[], None]:
  """Calls `callback(signum)` on each of `signals`; returns a function that uninstalls it.

  Must be called from the main thread (a Python rule for signal handlers). The
  callback runs in the main thread between bytecodes: keep it to setting a flag.
  """
  if threading.current_thread() is not threading.main_thread():
    raise RuntimeError("install_preemption_handler must be called from the main thread")
  previous = {}

  def uninstall() -> None:
    while previous:
      signum, handler = previous.popitem()
      # None means a handler installed outside Python; the default is the best we can do.
      signal.signal(signum, signal.SIG_DFL if handler is None else handler)

  try:
    for signum in signals:
      previous[signum] = signal.signal(signum, lambda s, _frame: callback(s))
  except BaseException:
    uninstall()
    raise
  return uninstall


def _check_positive(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_step(step: Any) -> int:
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"step must be a non-negative int, got {step!r}")
  return int(step)


def _check_abstract_state(abstract_state: Any) -> None:
  """Catches a wrong target before any file is read, so it is not taken for a torn file."""
  leaves = jax.tree_util.tree_leaves_with_path(abstract_state)
  if not leaves:
    raise ValueError("abstract_state has no leaves; pass jax.eval_shape(...) of the state")
  for path, leaf in leaves:
    name = jax.tree_util.keystr(path)
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      raise ValueError(f"abstract_state{name} is a {type(leaf).__name__}, not a jax.ShapeDtypeStruct")
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      try:
        sharding.shard_shape(leaf.shape)
      except Exception as e:  # pylint: disable=broad-except  # jax raises several types here
        raise ValueError(f"abstract_state{name}: {_one_line(e)}") from e


def _check_json_safe(value: Any, path: str) -> None:
  if value is None or isinstance(value, (bool, int, float, str)):
    return
  if isinstance(value, Mapping):
    for key, item in value.items():
      if not isinstance(key, str):
        raise TypeError(f"{path} has a non-str key {key!r}; JSON keys must be str")
      _check_json_safe(item, f"{path}[{key!r}]")
  elif isinstance(value, (list, tuple)):
    for i, item in enumerate(value):
      _check_json_safe(item, f"{path}[{i}]")
  else:
    raise TypeError(
        f"{path} is a {type(value).__name__}, not a JSON value; convert it "
        "(int(x), x.tolist(), config.to_dict()) or put arrays in state"
    )


def _one_line(error: BaseException, limit: int = 300) -> str:
  """The innermost cause, on one line (Orbax wraps TensorStore's precise error)."""
  while error.__cause__ is not None:
    error = error.__cause__
  text = " ".join(str(error).split()) or type(error).__name__
  return text if len(text) <= limit else text[:limit] + "..."


_agreements = [0]


def _all_processes_agree(ok: bool) -> bool:
  """True iff `ok` on every process (all processes must call it, in the same order)."""
  if jax.process_count() == 1:
    return ok
  _agreements[0] += 1
  tag = f"posttrain/checkpoint_agree/{_agreements[0]}"
  return all(distributed.allgather_json(bool(ok), tag))
