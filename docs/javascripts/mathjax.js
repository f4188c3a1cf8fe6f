// MathJax typesets the formulas that pymdownx.arithmatex marks (generic mode: \( \) inline, \[ \] display),
// and again after each page change of the site's instant navigation.
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true, processEnvironments: true },
  options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex" },
};

if (typeof document$ !== "undefined") {
  document$.subscribe(() => {
    if (window.MathJax.typesetPromise) {
      window.MathJax.typesetPromise();
    }
  });
}
