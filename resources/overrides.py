"""Run-config overrides of the experiment, typed from the experiment's own pydantic models.

Every field of ``ExperimentConfig``, recursively, becomes an optional field of a ``dg.Config`` class of the same
shape and description, so the launchpad offers each setting, type-checks an override and names its path when it
is wrong. Dagster's config types cannot say "at least 1" or check one field against another: those checks are
the models' own, run when the experiment loads, which the experiment resource does when the run starts, before
any op (``ExperimentResource.setup_for_execution``). Deriving the classes, rather than writing them out, keeps
them from drifting: a field added to the models is an override the next time the Definitions load.
"""

import functools
import types
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import dagster as dg
from pydantic import BaseModel, Field, create_model

from marl_pipeline.config import AgentConfig, ExperimentConfig

_SCALARS = (bool, int, float, str)


def _override_type(annotation: Any) -> Any:
    """The Dagster-expressible type of an override of a field annotated ``annotation``.

    Models become their override classes, ``X | None`` becomes X's type (None means "not overridden"), a literal
    becomes its values' type and anything Dagster has no type for is ``Any``: the model still validates it.
    """
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    origin = get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return overrides_of(annotation)
    if annotation in _SCALARS:
        return annotation
    if origin in (Union, types.UnionType):
        options = [option for option in get_args(annotation) if option is not type(None)]
        if len(options) > 1 and all(isinstance(o, type) and issubclass(o, BaseModel) for o in options):
            return overrides_of_variants(tuple(options))  # e.g. the advantage estimators, told apart by `type`
        return _override_type(options[0]) if len(options) == 1 else Any
    if origin is Literal:
        kinds = {type(value) for value in get_args(annotation)}
        return kinds.pop() if len(kinds) == 1 and kinds <= set(_SCALARS) else Any
    if origin is list:
        item = _override_type(get_args(annotation)[0])
        return list[item] if item in _SCALARS else Any
    if origin is dict:
        key, value = get_args(annotation)
        return dict[str, _override_type(value)] if key is str else Any
    return Any


@functools.cache
def overrides_of(model: type[BaseModel]) -> type[dg.Config]:
    """A ``dg.Config`` class with one optional field per field of ``model``, each None (not overridden) by default."""
    return _overrides_class((model,), f"{model.__name__}Overrides", f"Overrides of {model.__name__}.")


@functools.cache
def overrides_of_variants(models: tuple[type[BaseModel], ...]) -> type[dg.Config]:
    """One ``dg.Config`` class for a union of models (variants named by a ``type`` field): every field of any variant,
    optional. The variant chosen validates what is set when the experiment loads."""
    names = "Or".join(model.__name__ for model in models)
    return _overrides_class(models, f"{names}Overrides", f"Overrides of one of {names}.")


def _overrides_class(models: tuple[type[BaseModel], ...], name: str, doc: str) -> type[dg.Config]:
    fields = {}
    for model in models:
        for field_name, field in model.model_fields.items():
            if field_name not in fields:  # a field several variants share: the first one's type and description
                kind = _override_type(field.annotation)
                fields[field_name] = (kind if kind is Any else Optional[kind],  # noqa: UP045 (Dagster reads Optional)
                                      Field(None, description=field.description))
    return create_model(name, __base__=dg.Config, __doc__=doc, **fields)


AgentOverrides = overrides_of(AgentConfig)
ExperimentOverrides = create_model(
    "ExperimentOverrides", __base__=overrides_of(ExperimentConfig),
    __doc__="Overrides of the experiment, nested like its YAML file; unset fields keep the file's values.",
    every_agent=(Optional[AgentOverrides],  # noqa: UP045
                 Field(None, description="Applied to every agent of the experiment before `agents`' own "
                                         "overrides (e.g. `trainer: {lr: 0.0005}`).")))


def override_data(overrides: dg.Config | None, agents: list[str]) -> dict[str, Any]:
    """The overrides as a mapping nested like the experiment file, only the fields that were set.

    ``every_agent`` is spread over ``agents`` (the experiment's agent names), under each agent's own overrides.
    """
    if overrides is None:
        return {}
    data = set_fields(overrides)
    every_agent = data.pop("every_agent", None)
    if every_agent:
        from marl_pipeline.config import apply_overrides

        own = data.get("agents", {})
        data["agents"] = {**own, **{agent: apply_overrides(every_agent, own.get(agent, {})) for agent in agents}}
    return data


def set_fields(value: Any) -> Any:
    """A config value as plain data, without the fields left unset (None) in its ``dg.Config`` objects."""
    # Not model_dump(exclude_none=True): a None inside a free-form mapping (environment options) is a real value.
    if isinstance(value, BaseModel):
        return {name: set_fields(item) for name, item in value if item is not None}
    if isinstance(value, dict):
        return {key: set_fields(item) for key, item in value.items()}
    return value
