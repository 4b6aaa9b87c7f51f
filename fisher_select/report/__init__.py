"""Reports of a run: report.json (build) and report.html (page)."""
