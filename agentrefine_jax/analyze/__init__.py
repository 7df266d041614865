"""The paper's analyses: diversity (Figures 6-7), judge agreement (Figure 10), result tables and
figures (Tables 1-5, Figures 1, 8, 11). See docs/analyze.md."""
