"""Checks at launch: every setting and input known to fail late, refused before any model, tokenizer or Ray loads.

``validate_config`` (``config_schema.py``) checks the config alone. ``check_config(cfg)`` runs right after it (in
``main_ppo.run``, aliases resolved) and looks at what the config points to and at combinations the trainers or
workers would refuse only after the models are loaded or after the first rollout:

* estimators without their prerequisites: ``remax`` (no greedy baseline rollout), ``grpo_multiconv`` without a
  workflow, single-turn estimators in recurrent mode, ``gae`` without a loadable critic, KL in the reward without
  the reference model, DAPO group filtering (``algorithm.filter_groups.enable``) without recurrent mode
  (:func:`estimator_error`, :func:`kl_in_reward_error`, :func:`filter_groups_error`: the trainers call the same
  functions);
* settings not implemented: sequence parallelism on the ref model or the critic, KL estimators without an
  implementation (``full``), a vLLM tensor-parallel size the rollout cannot run (:func:`rollout_tp_errors`: it must
  divide the number of ranks and the model's attention heads, and async mode has no TP engine); LoRA adapters that do
  not merge into linear weights are refused when the actor loads (``verl/utils/lora.py``);
* paths: ``actor_rollout_ref.model.path`` (and ``critic.model.path`` for ``gae``) a local model folder,
  ``trainer.default_local_dir`` creatable and writable (a probe file is written and removed),
  ``custom_reward_function.path`` / ``.name`` importable and callable;
* data rows (``data.train_files``, ``data.val_files``; only the needed columns are read): every row has a
  ``data_source`` the reward routing knows (any value when a custom reward function is set) and a non-null
  ``reward_model.ground_truth``; messages name the file, the row and the field;
* resume: the checkpoint ``trainer.resume_mode`` would load must have been written with the same dataloader
  settings (``data.train_batch_size``, ``data.shuffle``, ``data.seed``, the number of training rows).

Every problem found is collected into one :class:`~verl.trainer.config_schema.ConfigError`.
"""

from __future__ import annotations

import math
import os
import pickle
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from verl.trainer.config.algorithm import rollout_is_on
from verl.trainer.config.data import file_list
from verl.trainer.config_schema import RECURRENT_ADV_ESTIMATORS, ConfigError, active_recurrent_name

__all__ = [
    "check_config",
    "estimator_error",
    "kl_in_reward_error",
    "filter_groups_error",
    "SINGLE_TURN_ESTIMATORS",
    "MULTI_TURN_ONLY_ESTIMATORS",
    "NOT_IMPLEMENTED_ESTIMATORS",
    "rollout_tp_errors",
]

# Built-in ``algorithm.adv_estimator`` values the single-turn trainer runs (gae with the critic group); it runs
# every other registered estimator too (upstream's grpo_passk, opo, ... and a recipe's @register_adv_est ones),
# except those below.
SINGLE_TURN_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus")
# Registered estimators that belong to recurrent mode (trajectory-level credit assignment).
MULTI_TURN_ONLY_ESTIMATORS = ("grpo_multiconv",)
# Registered estimators that no trainer can feed, with the reason.
NOT_IMPLEMENTED_ESTIMATORS = {
    "remax": "needs a greedy baseline rollout per prompt, which the single-turn trainer does not run",
}
# Rows named per problem before "and N more".
_MAX_ROWS_NAMED = 5


def check_config(cfg: Any) -> None:
    """Raise :class:`ConfigError` listing every launch-time problem of ``cfg`` (see the module docstring)."""
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    errors: list[str] = []
    try:
        recurrent = active_recurrent_name(cfg)
    except ConfigError as err:  # validate_config reports it too; keep going for the rest
        errors.extend(err.errors)
        recurrent = None
    errors += algorithm_errors(cfg, recurrent)
    errors += parallelism_errors(cfg, recurrent)
    errors += rollout_log_prob_errors(cfg)
    errors += bypass_mode_errors(cfg)
    errors += model_path_errors(cfg, recurrent)
    errors += folder_errors(cfg)
    errors += reward_function_errors(cfg)
    data_errors, train_rows = data_file_errors(cfg)
    errors += data_errors
    errors += resume_errors(cfg, train_rows)
    if errors:
        raise ConfigError(errors)


def _get(cfg: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(cfg, key, default=default, throw_on_missing=False)


def _uses_critic(cfg: DictConfig, recurrent: Optional[str]) -> bool:
    return recurrent is None and _get(cfg, "algorithm.adv_estimator") == "gae"


def _uses_ref(cfg: DictConfig) -> bool:
    return bool(_get(cfg, "actor_rollout_ref.actor.use_kl_loss")) or bool(_get(cfg, "algorithm.use_kl_in_reward"))


# ------------------------------------------------------------------------------------------------------------
# estimators and KL (shared with the trainers)
# ------------------------------------------------------------------------------------------------------------


def estimator_error(estimator: str, multi_turn: bool) -> Optional[str]:
    """Why ``algorithm.adv_estimator=estimator`` cannot train in this mode, or None when it can.

    The trainers raise with this message; :func:`check_config` reports it before anything loads.
    """
    if multi_turn:
        if estimator not in RECURRENT_ADV_ESTIMATORS:
            return (
                f"algorithm.adv_estimator={estimator!r} is not a multi-turn estimator "
                f"(valid with recurrent.enable: {', '.join(RECURRENT_ADV_ESTIMATORS)})"
            )
        return None
    if estimator in NOT_IMPLEMENTED_ESTIMATORS:
        return (
            f"algorithm.adv_estimator={estimator} {NOT_IMPLEMENTED_ESTIMATORS[estimator]}; use "
            f"{', '.join(SINGLE_TURN_ESTIMATORS)} or another registered estimator"
        )
    if estimator in MULTI_TURN_ONLY_ESTIMATORS:
        return (
            f"algorithm.adv_estimator={estimator!r} is not a single-turn estimator "
            f"({estimator} needs recurrent.enable; single-turn: {', '.join(SINGLE_TURN_ESTIMATORS)} or another "
            "registered estimator)"
        )
    return None  # any other registered name runs (an unknown one is validate_config's error)


def kl_in_reward_error(use_kl_in_reward: bool, use_kl_loss: bool) -> Optional[str]:
    """The single-turn trainer's KL-in-reward penalty needs the reference model, built only with the KL loss on."""
    if use_kl_in_reward and not use_kl_loss:
        return (
            "algorithm.use_kl_in_reward=True needs the reference model, which the actor worker builds "
            "only with actor_rollout_ref.actor.use_kl_loss=True (set actor.kl_loss_coef=0 to use it "
            "for the in-reward penalty only)"
        )
    return None


def filter_groups_error(enabled: bool, multi_turn: bool) -> Optional[str]:
    """DAPO dynamic sampling is implemented by the recurrent trainer only; the single-turn one would ignore it."""
    if enabled and not multi_turn:
        return (
            "algorithm.filter_groups.enable=True is only implemented in recurrent mode (recurrent.enable set); the "
            "single-turn trainer does not filter groups, so set algorithm.filter_groups.enable=False"
        )
    return None


def algorithm_errors(cfg: DictConfig, recurrent: Optional[str]) -> list[str]:
    """Estimator prerequisites and KL estimators that are selected but not implemented."""
    from verl.trainer.ppo.core_algos import UNSUPPORTED_KL_PENALTY_TYPES

    errors = []
    estimator = str(_get(cfg, "algorithm.adv_estimator"))
    problem = estimator_error(estimator, multi_turn=recurrent is not None)
    if problem:
        errors.append(problem)
    use_kl_loss, use_kl_in_reward = (
        bool(_get(cfg, "actor_rollout_ref.actor.use_kl_loss")),
        bool(_get(cfg, "algorithm.use_kl_in_reward")),
    )
    if recurrent is None:
        for problem in (
            kl_in_reward_error(use_kl_in_reward, use_kl_loss),
            filter_groups_error(bool(_get(cfg, "algorithm.filter_groups.enable")), multi_turn=False),
        ):
            if problem:
                errors.append(problem)
    for key, used, switch in (
        ("actor_rollout_ref.actor.kl_loss_type", use_kl_loss, "actor_rollout_ref.actor.use_kl_loss"),
        ("algorithm.kl_penalty", use_kl_in_reward, "algorithm.use_kl_in_reward"),
    ):
        kind = _get(cfg, key)
        if used and kind in UNSUPPORTED_KL_PENALTY_TYPES:
            errors.append(
                f"{key}={kind} is not implemented ({UNSUPPORTED_KL_PENALTY_TYPES[kind]}) and {switch}=True uses it; "
                "use low_var_kl, kl, abs or mse"
            )
    return errors


# ------------------------------------------------------------------------------------------------------------
# parallelism
# ------------------------------------------------------------------------------------------------------------


def parallelism_errors(cfg: DictConfig, recurrent: Optional[str]) -> list[str]:
    """Sequence parallelism of the ref model and the critic, rollout tensor parallelism."""
    errors = []
    # the actor's own size is checked by validate_config; the ref model and the critic have their own keys
    sp_keys = []
    if _uses_ref(cfg):
        sp_keys.append("actor_rollout_ref.ref.ulysses_sequence_parallel_size")
    if _uses_critic(cfg, recurrent):
        sp_keys.append("critic.ulysses_sequence_parallel_size")
    for key in sp_keys:
        size = _get(cfg, key, 1)
        if size not in (None, 1):
            errors.append(f"{key} must be 1: sequence parallelism is not implemented (got {size!r})")
    errors += rollout_tp_errors(cfg)
    return errors


def rollout_log_prob_errors(cfg: DictConfig) -> list[str]:
    """TIS (``algorithm.rollout_is``; null = on with ``trainer.rollout_overlap``) weighs the loss by the engine's
    log-probs, which the rollout returns only with ``actor_rollout_ref.rollout.calculate_log_probs`` (sync and async
    mode): without them TIS would silently weigh nothing."""
    key = "actor_rollout_ref.rollout.calculate_log_probs"
    if _get(cfg, key, True) is not False:
        return []
    rollout_is = _get(cfg, "algorithm.rollout_is")
    if not rollout_is_on(rollout_is, _get(cfg, "trainer.rollout_overlap"), _get(cfg, "algorithm.bypass_mode", False)):
        return []
    if rollout_is is None:
        why = "trainer.rollout_overlap=True (which turns algorithm.rollout_is on when it is null)"
    else:
        why = "algorithm.rollout_is=True"
    return [
        f"{key}=False with {why}: truncated importance sampling weighs the policy loss by the rollout engine's "
        f"log-probs, which the rollout does not return without {key}; set {key}=True or algorithm.rollout_is=False"
    ]


def bypass_mode_errors(cfg: DictConfig) -> list[str]:
    """``algorithm.bypass_mode`` takes PPO's old log-probs from the rollout engine, so every response token needs the
    engine's log-prob: refused without ``actor_rollout_ref.rollout.calculate_log_probs``, and in async mode, whose
    turns re-tokenised from text carry tokens the engine gave no log-prob for."""
    if not _get(cfg, "algorithm.bypass_mode", False):
        return []
    key = "actor_rollout_ref.rollout.calculate_log_probs"
    if _get(cfg, "actor_rollout_ref.rollout.mode") == "async":
        return [
            "algorithm.bypass_mode=True with actor_rollout_ref.rollout.mode=async: bypass mode uses the engine's "
            "log-prob of every response token as PPO's old log-prob, and async turns re-tokenised from text have "
            "tokens without one; set algorithm.bypass_mode=False (the actor recomputes them)"
        ]
    if _get(cfg, key, True) is False:
        return [
            f"algorithm.bypass_mode=True with {key}=False: bypass mode uses the rollout engine's log-probs as PPO's "
            f"old log-probs, which the rollout returns only with {key}=True; set it, or algorithm.bypass_mode=False"
        ]
    return []


def rollout_tp_errors(cfg: DictConfig) -> list[str]:
    """``actor_rollout_ref.rollout.tensor_model_parallel_size`` > 1 with vLLM: the ranks form TP groups sharing one
    engine (``verl/workers/rollout/tp_layout.py``). Refused when the model's attention heads cannot be split that many
    ways (vLLM would fail at engine start), or in async mode or with ``rollout.free_running_turns`` (requests reach
    each rank one at a time; a TP engine needs identical batches on all its ranks), or with ``trainer.rollout_overlap`` (the ranks' generations
    run vLLM's tensor-parallel collectives in their rollout threads while the train threads run FSDP's, in no
    agreed order across ranks: they can deadlock). That the size divides the number of ranks is ``validate_config``'s
    rule (``config_schema.py``). The ``hf`` engine runs one process per rank and ignores the key."""
    tp_key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    tp = _get(cfg, tp_key, 1)
    if _get(cfg, "actor_rollout_ref.rollout.name") != "vllm" or not isinstance(tp, int) or tp <= 1:
        return []
    errors = []
    mode = _get(cfg, "actor_rollout_ref.rollout.mode")
    if mode == "async":
        errors.append(
            f"{tp_key}={tp} with actor_rollout_ref.rollout.mode=async: async agents send requests to each rank on "
            f"their own, but the {tp} ranks sharing a tensor-parallel engine must run identical batches; set "
            f"{tp_key}=1 or actor_rollout_ref.rollout.mode=sync"
        )
    if _get(cfg, "actor_rollout_ref.rollout.free_running_turns") is True:
        errors.append(
            f"actor_rollout_ref.rollout.free_running_turns=True with {tp_key}={tp}: free-running trajectories send "
            f"requests to each rank on their own, but the {tp} ranks sharing a tensor-parallel engine must run "
            f"identical batches; set {tp_key}=1 or actor_rollout_ref.rollout.free_running_turns=False"
        )
    if _get(cfg, "trainer.rollout_overlap"):
        errors.append(
            f"trainer.rollout_overlap=True with {tp_key}={tp}: a tensor-parallel vLLM engine runs collectives across "
            f"its {tp} ranks while generating, and with the overlap the same ranks run the actor update's FSDP "
            f"collectives at the same time in another thread, in no order agreed between ranks (a deadlock); set "
            f"{tp_key}=1 (one engine per rank) or trainer.rollout_overlap=False"
        )
    errors += _attention_heads_errors(tp_key, tp, _get(cfg, "actor_rollout_ref.model.path"))
    return errors


def _attention_heads_errors(tp_key: str, tp: int, model_path: Any) -> list[str]:
    """vLLM splits the query heads evenly over the TP ranks, and the key/value heads too (or replicates them when
    there are fewer than ranks): read from the model's config.json where it is readable."""
    import json

    try:
        with open(os.path.join(str(model_path), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError, TypeError):
        return []  # model_path_errors reports a missing or unreadable model
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return []
    if heads % tp:
        return [f"{tp_key}={tp} must divide the model's num_attention_heads ({heads}, {model_path}/config.json)"]
    if kv_heads % tp and tp % kv_heads:
        return [
            f"{tp_key}={tp} and the model's num_key_value_heads ({kv_heads}, {model_path}/config.json): one must "
            "divide the other for vLLM to split or replicate the key/value heads"
        ]
    return []


# ------------------------------------------------------------------------------------------------------------
# paths: models, output folder, reward function
# ------------------------------------------------------------------------------------------------------------


def _model_folder_error(key: str, path: Any) -> Optional[str]:
    """Mirrors ``verl.utils.model_loading.load_causal_lm``: a local folder, as given (``~`` is not expanded)."""
    if path is None or str(path).strip() == "":
        return f"{key} is empty: set it to the local folder of a Hugging Face model (config.json + weights)"
    path = str(path)
    if not os.path.isdir(path):
        hint = ""
        if path.startswith("~") and os.path.isdir(os.path.expanduser(path)):
            hint = f"; '~' is not expanded, write {os.path.expanduser(path)}"
        return f"{key}={path} is not a local folder (nothing is downloaded at run time){hint}"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"{key}={path} has no config.json: not a Hugging Face model folder"
    return None


def model_path_errors(cfg: DictConfig, recurrent: Optional[str]) -> list[str]:
    """The policy's model folder (tokenizer, actor, ref, rollout) and, for ``gae``, the critic's."""
    keys = ["actor_rollout_ref.model.path"]
    if _uses_critic(cfg, recurrent):
        keys.append("critic.model.path")
    problems = [_model_folder_error(key, _get(cfg, key)) for key in keys]
    return [p for p in problems if p]


def _writable_folder_error(key: str, folder: Any) -> Optional[str]:
    """Create ``folder`` (and parents) if needed, write and remove a probe file; remove the folders created."""
    if folder is None or str(folder).strip() == "":
        return f"{key} is empty: set it to a folder path"
    root = Path(str(folder)).expanduser().absolute()
    created = []
    missing = root
    while not missing.exists() and missing != missing.parent:
        created.append(missing)
        missing = missing.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write_probe_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return f"{key}={folder} is not a writable folder ({type(err).__name__}: {err.strerror or err})"
    finally:
        for path in created:  # deepest first: leave the filesystem as it was
            try:
                path.rmdir()
            except OSError:
                break
    return None


def _absolute(path: Any) -> Path:
    return Path(str(path)).expanduser().absolute()


def folder_errors(cfg: DictConfig) -> list[str]:
    """``trainer.default_local_dir`` (checkpoints, and the logs by default) and a ``trainer.log_dir`` outside it."""
    problems = [_writable_folder_error("trainer.default_local_dir", _get(cfg, "trainer.default_local_dir"))]
    log_dir, ckpt = _get(cfg, "trainer.log_dir"), _get(cfg, "trainer.default_local_dir")
    if log_dir and not (ckpt and _absolute(log_dir).is_relative_to(_absolute(ckpt))):
        problems.append(_writable_folder_error("trainer.log_dir", log_dir))
    return [p for p in problems if p]


def _custom_reward_path(cfg: DictConfig) -> Optional[str]:
    path = _get(cfg, "custom_reward_function.path")
    return str(path) if path not in (None, "") else None


def reward_function_errors(cfg: DictConfig) -> list[str]:
    """``custom_reward_function.path`` imports and defines a callable ``custom_reward_function.name``
    (loaded exactly as the trainer loads it: ``main_ppo.load_custom_reward_fn``)."""
    path = _custom_reward_path(cfg)
    if path is None:
        return []
    if not os.path.isfile(path):
        return [f"custom_reward_function.path={path} is not a file"]
    from verl.trainer.main_ppo import load_custom_reward_fn

    try:
        fn = load_custom_reward_fn(cfg)
    except AttributeError as err:
        return [str(err)]
    except Exception as err:  # noqa: BLE001 - any error while importing the user's file is the finding
        return [f"custom_reward_function.path={path} cannot be imported ({type(err).__name__}: {err})"]
    if not callable(fn):
        name = _get(cfg, "custom_reward_function.name") or "compute_score"
        return [f"custom_reward_function.name={name!r} in {path} is not callable (got {type(fn).__name__})"]
    return []


# ------------------------------------------------------------------------------------------------------------
# data rows
# ------------------------------------------------------------------------------------------------------------


def _rows_text(rows: Sequence[int]) -> str:
    named = ", ".join(str(r) for r in rows[:_MAX_ROWS_NAMED])
    more = f" and {len(rows) - _MAX_ROWS_NAMED} more" if len(rows) > _MAX_ROWS_NAMED else ""
    return f"row{'s' if len(rows) > 1 else ''} {named}{more}"


def _read_columns(path: Path, wanted: Sequence[str]):
    """``(number of rows, {column: list of values})`` for the ``wanted`` columns present in the file.

    Parquet: only those columns are read (pyarrow); json/jsonl: the file is parsed with pandas, as the dataset does.
    """
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        names = set(pq.read_schema(path).names)
        present = [c for c in wanted if c in names]
        table = pq.read_table(path, columns=present)
        return table.num_rows, {c: table.column(c).to_pylist() for c in present}
    from verl.utils.dataset.rl_dataset import _read_file

    frame = _read_file(path, suffix)
    return len(frame), {c: frame[c].tolist() for c in wanted if c in frame.columns}


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _file_row_errors(
    key: str, file: str, any_source: bool, source_key: str = "data_source"
) -> tuple[list[str], Optional[int]]:
    """Problems of one data file and its number of rows (None when it cannot be read); ``source_key``: the
    column that routes each row to its scorer (``data.reward_fn_key``)."""
    from verl.utils.reward_score import known_data_sources, resolve_scorer

    path = Path(file)
    if not path.exists():
        return [f"{key}: data file not found: {file}"], None
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".jsonl", ".json"):
        return [f"{key}: unsupported data file type {suffix!r} for {file} (expected .parquet, .json, .jsonl)"], None
    if path.stat().st_size == 0:
        return [f"{key}: data file {file} is empty (0 bytes)"], None
    try:
        n_rows, columns = _read_columns(path, (source_key, "reward_model"))
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        return [f"{key}: cannot read data file {file}: {err}"], None
    if n_rows == 0:
        return [f"{key}: data file {file} has no rows"], 0
    errors = []
    if "reward_model" not in columns:
        errors.append(
            f"{file}: missing column 'reward_model' ({key}): every row needs field reward_model.ground_truth "
            "for the reward"
        )
    else:
        no_truth = [
            i
            for i, cell in enumerate(columns["reward_model"])
            if not isinstance(cell, dict) or _is_null(cell.get("ground_truth"))
        ]
        if no_truth:
            errors.append(
                f"{file} {_rows_text(no_truth)} ({key}): field reward_model.ground_truth is null or missing; "
                "such a row would be scored 0"
            )
    if source_key != "data_source" and source_key not in columns:
        errors.append(f"{file}: missing column {source_key!r} ({key}), named by data.reward_fn_key")
    # no data_source column: the reward managers route every row as hotpotqa (a known source)
    if not any_source and source_key in columns:
        unknown: dict[Any, list[int]] = {}
        verdict: dict[Any, bool] = {}
        for i, source in enumerate(columns[source_key]):
            hashable = source if isinstance(source, (str, type(None), int, float)) else repr(source)
            if hashable not in verdict:
                try:
                    resolve_scorer(source)
                    verdict[hashable] = True
                except ValueError:
                    verdict[hashable] = False
            if not verdict[hashable]:
                unknown.setdefault(hashable, []).append(i)
        for source, rows in unknown.items():
            errors.append(
                f"{file} {_rows_text(rows)} ({key}): field {source_key}={source!r} has no reward scorer (known "
                f"data_source prefixes: {', '.join(known_data_sources())}); set custom_reward_function.path or "
                "register one with verl.utils.reward_score.register_scorer"
            )
    return errors, n_rows


def data_file_errors(cfg: DictConfig) -> tuple[list[str], Optional[int]]:
    """Row problems of ``data.train_files`` and ``data.val_files``, and the number of training rows (None when
    some training file could not be read)."""
    any_source = _custom_reward_path(cfg) is not None
    errors: list[str] = []
    train_rows: Optional[int] = 0
    for key in ("data.train_files", "data.val_files"):
        for file in file_list(_get(cfg, key)):
            problems, n_rows = _file_row_errors(key, file, any_source, _get(cfg, "data.reward_fn_key", "data_source"))
            errors += problems
            if key == "data.train_files":
                train_rows = None if n_rows is None or train_rows is None else train_rows + n_rows
    return errors, train_rows


# ------------------------------------------------------------------------------------------------------------
# resume
# ------------------------------------------------------------------------------------------------------------


def _resume_dir(cfg: DictConfig) -> tuple[Optional[Path], Optional[str]]:
    """The checkpoint ``fit`` would resume from (as ``CheckpointManager.resolve_resume``), or an error message."""
    from verl.utils.checkpoint import CheckpointManager
    from verl.utils.checkpoint.manager import CheckpointError, validate_checkpoint_dir

    mode = _get(cfg, "trainer.resume_mode", "auto")
    if mode == "disable":
        return None, None
    if mode == "resume_path":
        path = _get(cfg, "trainer.resume_from_path")
        try:
            return validate_checkpoint_dir(path), None
        except (FileNotFoundError, CheckpointError, TypeError) as err:
            return None, f"trainer.resume_from_path={path}: {err}"
    root = _get(cfg, "trainer.default_local_dir")
    return (CheckpointManager(root).find_latest() if root else None), None


def resume_errors(cfg: DictConfig, train_rows: Optional[int]) -> list[str]:
    """The dataloader settings saved with the checkpoint to resume from must match the config (the saved position
    counts batches of the saved size over the saved rows: another batch size would continue elsewhere)."""
    ckpt, problem = _resume_dir(cfg)
    if problem:
        return [problem]
    if ckpt is None:
        return []
    state_file = ckpt / "trainer_state.pkl"
    try:
        with open(state_file, "rb") as f:
            saved = pickle.load(f)["dataloader"]
    except (OSError, KeyError, TypeError, pickle.UnpicklingError, EOFError) as err:
        return [f"trainer.resume_mode={_get(cfg, 'trainer.resume_mode')}: cannot read {state_file} ({err})"]
    now = {
        "batch_size": (
            ("data.gen_batch_size", _get(cfg, "data.gen_batch_size"))
            if _get(cfg, "data.gen_batch_size")
            else ("data.train_batch_size", _get(cfg, "data.train_batch_size"))
        ),
        "shuffle": ("data.shuffle", bool(_get(cfg, "data.shuffle", True))),
        "seed": ("data.seed", int(_get(cfg, "data.seed", 1) or 1)),
    }
    if train_rows is not None and not _get(cfg, "data.filter_overlong_prompts", False):
        now["dataset_len"] = ("the number of rows of data.train_files", train_rows)
    errors = []
    for field, (key, value) in now.items():
        if field in saved and saved[field] != value:
            errors.append(
                f"{key} is {value!r} but the checkpoint {ckpt} (trainer.resume_mode="
                f"{_get(cfg, 'trainer.resume_mode')}) was written with {saved[field]!r}: its dataloader position "
                "cannot continue with another value; set it back, or start fresh with trainer.resume_mode=disable "
                "or another trainer.default_local_dir"
            )
    return errors
