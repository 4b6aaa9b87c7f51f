"""Older run formats upgraded in place (``fisher-select migrate``): only report.json changes, tensors never do."""

from __future__ import annotations

import os
from pathlib import Path

from fisher_select.atomic import write_file
from fisher_select.errors import FisherSelectError
from fisher_select.run.io import read_json, write_json
from fisher_select.run.names import REPORT_FILE
from fisher_select.run.schema import FORMAT_VERSION, RunReport


# Format 2 -> 3: the module masses got one name each (fisher_mass / bound_mass, never "mass").
_MODULE_RENAMES_2 = {"mass_share": "fisher_share", "sqrt_fisher_mass": "bound_mass", "sqrt_mass_share": "bound_share"}
_STATISTICS_RENAMES_2 = {"stability": {"spearman_sqrt_mass": "spearman_bound_mass", "spearman_mass": "spearman_fisher_mass",
                                       "module_sqrt_mass": "module_bound_mass"},
                         "concentration": {"mass_shares": "fisher_mass_shares"}}


# Format 3 -> 4: the mean of sqrt(F) says what it is.
_MODULE_RENAMES_3 = {"sqrt_fisher_mean": "bound_mass_per_coordinate"}


def _rename(entry, renames: dict) -> None:
    for old, new in renames.items():
        if isinstance(entry, dict) and old in entry:
            entry[new] = entry.pop(old)


def migrate(path: "str | os.PathLike") -> Path:
    """Upgrade a run directory of an older format in place (only report.json changes; tensors never do).

    Format 1 (fisher_select 0.1.0) lacked the version key; format 2 named the module masses
    ``mass_share`` / ``sqrt_fisher_mass`` / ``sqrt_mass_share``, now ``fisher_share`` / ``bound_mass`` /
    ``bound_share``; format 3 named ``bound_mass_per_coordinate`` ``sqrt_fisher_mean``.
    """
    report_path = Path(path) / REPORT_FILE
    if not report_path.is_file():
        raise FisherSelectError(f"{path} is not a fisher_select run directory (no {REPORT_FILE})")
    data = read_json(report_path)
    version = data.get("format_version", 1)
    if version == FORMAT_VERSION:
        return report_path
    if version not in (1, 2, 3):
        raise FisherSelectError(f"{report_path} has run format {version}, which this release cannot migrate")
    if version < 3:
        for module in data.get("modules", []):
            _rename(module, _MODULE_RENAMES_2)
        for section, renames in _STATISTICS_RENAMES_2.items():
            _rename((data.get("statistics") or {}).get(section), renames)
    for module in data.get("modules", []):
        _rename(module, _MODULE_RENAMES_3)
    data["format_version"] = FORMAT_VERSION
    RunReport.from_json(data, str(report_path))  # refuse what would not load afterwards
    write_file(report_path, lambda tmp: write_json(tmp, data), overwrite=True)
    return report_path
