"""Read manifests the way `kubectl apply` does, where PyYAML (YAML 1.1) would differ.

- Floats: YAML 1.2 (kubectl's YAML) reads `1e-6` as a number; YAML 1.1 needs a dot (`1.0e-6`), so
  PyYAML would hand validation the string '1e-6'. Exponents without a dot are floats here.
- Duplicate keys: kubectl refuses a mapping with a key twice; PyYAML silently keeps the last value.
  Here they are an error naming the key and both lines. A merge key (`<<: *anchor`) is no
  duplicate: keys set beside it override the merged ones, as in kubectl.
"""
from __future__ import annotations

import re

import yaml
from yaml.constructor import ConstructorError

_FLOAT_TAG = "tag:yaml.org,2002:float"
_MERGE_TAG = "tag:yaml.org,2002:merge"
# PyYAML's YAML 1.1 float pattern plus `1e-6` / `-2E+3` (digits, exponent, no dot).
_FLOAT_RE = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                    |\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.VERBOSE)


class ManifestLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 exponent floats and duplicate keys refused."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:  # flatten_mapping (in super) merges these
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: let PyYAML report it
                    continue
                if first is not key_node:
                    raise ConstructorError(
                        None, None,
                        f"duplicate key {key!r} (first at line {first.start_mark.line + 1}); "
                        "kubectl refuses it too: keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


ManifestLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _FLOAT_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ManifestLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))
ManifestLoader.add_constructor("tag:yaml.org,2002:map", ManifestLoader.construct_yaml_map)


def load_all(text: str) -> list:
    """Every YAML document of `text` (None for empty ones). Raises yaml.YAMLError."""
    return list(yaml.load_all(text, Loader=ManifestLoader))
