// pglane web: refresh the block marked data-refresh="SECONDS" in place, from the same page asked for its
// fragment (?fragment=1), so the page never reloads and keeps its scroll. Paused while the tab is hidden.
// Without JavaScript the page is the same, only static: reload it to read it again.
(function () {
  "use strict";
  function refresh(block) {
    if (document.hidden) { return; }
    var url = new URL(window.location.href);
    url.searchParams.set("fragment", "1");
    fetch(url.toString(), { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        block.innerHTML = html;  // rendered and escaped by the server's templates
        block.removeAttribute("data-stale");
        block.dispatchEvent(new CustomEvent("pglane:refreshed", { bubbles: true }));
      })
      .catch(function () { block.setAttribute("data-stale", "true"); });
  }
  document.querySelectorAll("[data-refresh]").forEach(function (block) {
    var seconds = Math.max(1, Number(block.getAttribute("data-refresh")) || 5);
    window.setInterval(function () { refresh(block); }, seconds * 1000);
  });
})();
