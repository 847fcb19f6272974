"""Rendering only: the best-config table and its exports, fitting to the terminal, the progress
bar, what compare/profile print, and the HTML report; nothing here measures or decides."""
