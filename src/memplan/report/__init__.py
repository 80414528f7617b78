"""`memplan report`: capacity-planning pages (Markdown with PNG/SVG plots, and self-contained HTML).

- series: the numbers plotted, from memplan.api.estimate (pure);
- plots: matplotlib figures (the `report` extra, imported only when drawing);
- doc: the page as blocks, rendered to Markdown and offline HTML;
- page: one job's page; seed / claims: the seed article's verdict (reports/176b-seq32k-8xa100.md);
- write: atomic writing; command: the CLI (add_arguments, run).
"""
