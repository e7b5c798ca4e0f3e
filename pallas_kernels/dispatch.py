"""Backend choice shared by the kernels' public functions: `implementation=` is one name or a sequence of
names tried in order, a backend refusing a call with NotImplementedError (the tokamax pattern)."""

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

Result = TypeVar("Result")


def implementation_names(implementation: str | Sequence[str], known: Mapping[str, object]) -> tuple[str, ...]:
    """`implementation` as a tuple of names.

    Raises:
      ValueError: an empty sequence, or a name not in `known` (the message lists the choices).
    """
    names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    if not names or any(name not in known for name in names):
        raise ValueError(f"unknown implementation {implementation!r}; choose from {sorted(known)}")
    return names


def first_accepted(names: tuple[str, ...], call: Callable[[str], Result]) -> Result:
    """`call(name)` of the first name whose backend does not refuse the call.

    Raises:
      NotImplementedError: a single name's refusal as it is (an explicit choice never falls back); for a
        sequence, every implementation refused, naming each refusal.
    """
    refusals = []
    for name in names:
        try:
            return call(name)
        except NotImplementedError as error:
            if len(names) == 1:
                raise
            refusals.append(f"{name}: {error}")
    raise NotImplementedError(f"every implementation refused ({', '.join(names)}): " + "; ".join(refusals))
