"""Reporting: the best-config table, its exports, and the compare/profile investigation."""
