"""Everything that turns result files into HTML, Markdown, JUnit and tables; reads result files only."""
