"""Results and what is made of them: sealed done-markers, the class book, reports, feedback pages, written-answer scores, similarity."""
