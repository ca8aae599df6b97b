"""PagedWeight: expert weights in pages at bit widths that change while serving (engine `pagedweight`)."""
