"""Reports of a run: report.json (build, statistics), report.md (markdown), report.html (page, plots),
their sentences (text), fast top-k histograms (topk) and run comparisons (compare). docs/REPORT.md."""
