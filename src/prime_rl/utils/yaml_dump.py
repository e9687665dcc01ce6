"""YAML for the files launchers read (k8s/, cloud/): documents dumped by the YAML library, never templated, with
multi-line strings (configs, run scripts) as literal blocks and no &anchors, so the file reads as written."""

from __future__ import annotations

import yaml


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _text)


def dump_yaml(*documents: dict) -> str:
    """The documents, `---`-separated, keys in the order given."""
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False)
