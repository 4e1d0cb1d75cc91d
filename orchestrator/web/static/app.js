// The inspector's only script: "select all" checkboxes. No inline script anywhere (the
// Content-Security-Policy allows scripts from this origin's files only).
document.addEventListener("DOMContentLoaded", () => {
  for (const all of document.querySelectorAll("input.all")) {
    all.addEventListener("change", () => {
      const table = all.closest("table");
      for (const box of table.querySelectorAll("tbody input[type=checkbox]")) {
        box.checked = all.checked;
      }
    });
  }
});
