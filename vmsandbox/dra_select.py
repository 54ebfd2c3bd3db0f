"""Which of this node's DRA devices a ResourceClaim's request would get (pure): the DeviceClass's and
the request's CEL selectors evaluated, as the scheduler evaluates them, over the devices this node's
vmsandbox publishes (built by ``vmsandbox.dra.network_device`` and ``vmsandbox.dra_pci.pci_device``).

* ``device_input``: a ResourceSlice device (``resource.k8s.io/v1`` ``Device``) as a selector sees it,
  the object named ``device``: ``driver``, ``attributes`` and ``capacity`` grouped by domain (a
  name without a domain is the driver's), ``allowMultipleAllocations``. A domain the device has
  nothing in is an empty map; a name the device does not have is an evaluation error, as the API
  documents.
* ``compile_selector``: one expression, refused past the API server's length bound (10 Ki
  characters) or when it does not compile.
* ``select_request``: the devices matching every selector of the class and of the request, in the
  order published, then ``allocationMode`` applied (``ExactCount``: the first ``count``; ``All``:
  every match). A selector that fails to compile or to evaluate, or whose result is not a bool, on
  any device, is an error naming the claim, the request, the selector and the device: the
  scheduler aborts that claim's allocation.
* ``select_claims``: each request ``vmsandbox.dra.plan_claims`` found, with its selectors read
  from the claim or template and DeviceClass manifests beside the pod; the two classes of
  deploy/dra/deviceclass.yaml are known by name when their manifest is not given.

The CEL is cel-python's: the standard CEL language and functions. Kubernetes' extension libraries
(``cel.bind``, semver and quantity values, ``includes``) are not in it; such an expression is an
evaluation error here. A ``version`` attribute is seen as a string, a capacity as its quantity string.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import celpy
from celpy import celtypes
from celpy.evaluation import CELEvalError

from vmsandbox import validation
from vmsandbox.dra import get_path
from vmsandbox.errors import InvalidArgument

MAX_EXPRESSION = 10 * 1024  # the API server's bound on a CEL selector's length
SHOWN = 120  # characters of an expression an error quotes
MAX_SELECTORS = 32  # the API's bound on a class's and on a request's selectors
MAX_COUNT = 32  # the API's bound on a claim's allocated devices (resource.k8s.io AllocationResultsMaxSize)

# deploy/dra/deviceclass.yaml: the selectors of the driver's classes, for a pod file without them
KNOWN_CLASSES = {
    "vmsandbox-network": ('device.driver == "{driver}" && device.attributes["{driver}"].type == "network"',),
    "vmsandbox-pci": ('device.driver == "{driver}" && device.attributes["{driver}"].type == "pci"',),
}


@dataclass(frozen=True)
class Selector:
    origin: str  # "class NAME selector I" or "request selector I"
    expression: str


@dataclass(frozen=True)
class Selection:
    """What one request would get of this node's devices of the driver."""

    devices: tuple[str, ...] = ()  # the devices allocated, in the order published
    matches: tuple[str, ...] = ()  # every device all the selectors accept
    reason: str = ""  # why it gets none, or fewer than it asks for
    error: str = ""  # a selector that does not compile or evaluate: the scheduler allocates nothing
    ours: bool = False  # the class names this driver (``device.driver == "<driver>"``, or is one of its own)


class _Domains(celtypes.MapType):
    """``device.attributes`` / ``device.capacity``: a domain the device has nothing in is an empty map."""

    def __getitem__(self, key: Any) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            return celtypes.MapType({})


def _value(value: object) -> Any:
    if isinstance(value, dict) and len(value) == 1:
        kind, v = next(iter(value.items()))
        if kind == "bool" and isinstance(v, bool):
            return celtypes.BoolType(v)
        if kind == "int" and isinstance(v, int) and not isinstance(v, bool):
            return celtypes.IntType(v)
        if kind in ("string", "version") and isinstance(v, str):
            return celtypes.StringType(v)
    raise InvalidArgument(
        f"device attribute value {validation.quote(str(value))}: not one of bool, int, string, version"
    )


def _grouped(driver: str, items: Mapping[str, Any], convert: Any) -> _Domains:
    groups: dict[str, dict[celtypes.StringType, Any]] = {}
    for qualified, value in items.items():
        domain, _, name = qualified.rpartition("/")
        groups.setdefault(domain or driver, {})[celtypes.StringType(name)] = convert(value)
    return _Domains({celtypes.StringType(d): celtypes.MapType(v) for d, v in groups.items()})


def _quantity(value: object) -> Any:
    if isinstance(value, dict) and isinstance(value.get("value"), str):
        return celtypes.StringType(value["value"])
    raise InvalidArgument(f"device capacity {validation.quote(str(value))}: no quantity value")


def device_input(driver: str, device: Mapping[str, Any]) -> celtypes.MapType:
    """The ``device`` object a selector sees for one published device."""
    return celtypes.MapType(
        {
            celtypes.StringType("driver"): celtypes.StringType(driver),
            celtypes.StringType("attributes"): _grouped(driver, device.get("attributes") or {}, _value),
            celtypes.StringType("capacity"): _grouped(driver, device.get("capacity") or {}, _quantity),
            celtypes.StringType("allowMultipleAllocations"): celtypes.BoolType(
                bool(device.get("allowMultipleAllocations"))
            ),
        }
    )


def _shown(selector: Selector) -> str:
    return f"{selector.origin} {validation.quote(selector.expression, SHOWN)}"


def _message(exc: BaseException) -> str:
    text = str(exc.args[0]) if exc.args else type(exc).__name__
    return validation.bound(text.split(" (in activation")[0].split("\n")[0], 200)


@functools.cache
def _env() -> celpy.Environment:
    """The one CEL environment, made on first use (cel-python builds its parser from the grammar it ships)."""
    return celpy.Environment()


def compile_selector(selector: Selector) -> Any:
    """The runnable program of one selector; InvalidArgument past the length bound or when it does not compile."""
    if len(selector.expression) > MAX_EXPRESSION:
        raise InvalidArgument(
            f"{_shown(selector)}: {len(selector.expression)} characters, more than the API's {MAX_EXPRESSION}"
        )
    try:
        return _env().program(_env().compile(selector.expression))
    except Exception as exc:  # the parser's errors are of many kinds; each is the selector's
        raise InvalidArgument(f"{_shown(selector)}: does not compile: {_message(exc)}") from None


def _accepts(program: Any, selector: Selector, name: str, device: celtypes.MapType) -> bool:
    try:
        result = program.evaluate({"device": device})
    except Exception as exc:  # an evaluation error, whatever the interpreter raises
        raise InvalidArgument(f"{_shown(selector)}: device {name}: {_message(exc)}") from None
    if isinstance(result, CELEvalError):
        raise InvalidArgument(f"{_shown(selector)}: device {name}: {_message(result)}")
    if not isinstance(result, celtypes.BoolType):
        raise InvalidArgument(f"{_shown(selector)}: device {name}: the result is {type(result).__name__}, not a bool")
    return bool(result)


def select_request(
    where: str,
    selectors: Sequence[Selector],
    driver: str,
    devices: Sequence[Mapping[str, Any]],
    mode: str = "ExactCount",
    count: int = 1,
) -> Selection:
    """The devices one request would get (``where``: "resourceClaims C request R" for messages)."""
    try:
        programs = [(compile_selector(s), s) for s in selectors]
        inputs = [(str(d.get("name", "")), device_input(driver, d)) for d in devices]
        matches = tuple(name for name, dev in inputs if all(_accepts(p, s, name, dev) for p, s in programs))
    except InvalidArgument as exc:
        return Selection(error=f"{where}: {exc}")
    if not matches:
        have = ", ".join(str(d.get("name", "")) for d in devices) or "none"
        return Selection(reason=f"no {driver} device of this node matches (published: {have})")
    if mode == "All":
        return Selection(matches, matches)
    if len(matches) < count:
        return Selection((), matches, f"asks for {count}, {len(matches)} of this node's {driver} devices match")
    return Selection(matches[:count], matches)


# ---- the manifests beside the pod --------------------------------------------------------------


def _expressions(selectors: object, where: str) -> list[str]:
    if selectors is None:
        return []
    if not isinstance(selectors, list) or len(selectors) > MAX_SELECTORS:
        raise InvalidArgument(f"{where}: selectors must be a list of at most {MAX_SELECTORS}")
    out = []
    for i, sel in enumerate(selectors):
        expression = get_path(sel, "cel.expression")
        if not isinstance(expression, str):
            raise InvalidArgument(f"{where}: selectors[{i}].cel.expression: missing (only CEL selectors exist)")
        out.append(expression)
    return out


def class_selectors(name: str, docs: Sequence[Any], driver: str) -> tuple[Selector, ...] | None:
    """The DeviceClass's selectors, from its manifest among ``docs`` or the driver's own classes;
    None when neither has it."""
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "DeviceClass" and get_path(doc, "metadata.name") == name:
            found = _expressions(get_path(doc, "spec.selectors"), f"DeviceClass {name}")
            return tuple(Selector(f"class {name} selector {i}", e) for i, e in enumerate(found))
    if name in KNOWN_CLASSES:
        return tuple(
            Selector(f"class {name} selector {i}", e.format(driver=driver)) for i, e in enumerate(KNOWN_CLASSES[name])
        )
    return None


def _claim_spec(docs: Sequence[Any], namespace: str, source: str) -> Any:
    what, _, wanted = source.partition(" ")
    kind = "ResourceClaimTemplate" if what == "template" else "ResourceClaim"
    for d in docs:
        if (
            isinstance(d, dict)
            and d.get("kind") == kind
            and get_path(d, "metadata.name") == wanted
            and (get_path(d, "metadata.namespace") or "default") == namespace
        ):
            return get_path(d, "spec.spec" if kind == "ResourceClaimTemplate" else "spec")
    return None


def _request(spec: Any, request: str) -> Mapping[str, Any]:
    """The ``exactly`` (or the ``firstAvailable`` sub-request) a request name ("r" or "r/sub") names."""
    top, _, sub = request.partition("/")
    for req in get_path(spec, "devices.requests") or []:
        if get_path(req, "name") != top:
            continue
        if not sub:
            exactly = get_path(req, "exactly")
            return exactly if isinstance(exactly, dict) else {}
        for choice in get_path(req, "firstAvailable") or []:
            if get_path(choice, "name") == sub and isinstance(choice, dict):
                return choice
    return {}


def _mode(req: Mapping[str, Any], where: str) -> tuple[str, int]:
    mode = req.get("allocationMode") or "ExactCount"
    count = req.get("count", 1)
    if mode not in ("ExactCount", "All"):
        raise InvalidArgument(f"{where}: allocationMode {validation.quote(str(mode))}: not ExactCount or All")
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
        raise InvalidArgument(f"{where}: count must be an integer from 1 to {MAX_COUNT}")
    return mode, count


def names_driver(selectors: Sequence[Selector], driver: str) -> bool:
    """Whether a class's selectors pin the driver (``device.driver == "<driver>"``): a class of another
    driver matches none of this node's devices and is not this node's refusal."""
    pin = re.compile(r"""device\.driver\s*==\s*["']""" + re.escape(driver) + """["']""")
    return any(pin.search(s.expression) for s in selectors)


def select_claims(
    requests: Sequence[Any],
    docs: Sequence[Any],
    namespace: str,
    driver: str,
    devices: Sequence[Mapping[str, Any]],
) -> tuple[Selection, ...]:
    """A ``Selection`` for each of ``vmsandbox.dra.plan_claims``'s requests (its claim, source,
    request and device_class), over ``devices``: this node's published devices of ``driver``. A
    request whose claim manifest is not given selects nothing (plan notes it)."""
    out = []
    for r in requests:
        if not r.source:
            out.append(Selection(reason="its ResourceClaim or template is not in the manifest"))
            continue
        where = f"resourceClaims {r.claim} request {r.request}"
        selectors = class_selectors(r.device_class, docs, driver)
        if selectors is None:
            out.append(
                Selection(reason=f"DeviceClass {r.device_class} is not in the manifest: its selectors are unknown")
            )
            continue
        req = _request(_claim_spec(docs, namespace, r.source), r.request)
        mode, count = _mode(req, where)
        own = tuple(
            Selector(f"request selector {i}", e)
            for i, e in enumerate(_expressions(req.get("selectors"), f"{where} ({r.source})"))
        )
        got = select_request(where, selectors + own, driver, devices, mode, count)
        out.append(replace(got, ours=names_driver(selectors, driver)))
    return tuple(out)
