"""The run's report: its content built from a calibration or a run directory (build: report.json,
handed to ``run.write``), statistics, report.md (markdown), report.html (page, plots), their
sentences (text, warnings), the validation and outcome sections, and run comparisons laid out
(compare). docs/REPORT.md."""
